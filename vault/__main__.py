from vault.cli import main

main()
