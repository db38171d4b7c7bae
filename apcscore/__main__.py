from apcscore.cli import main

main()
