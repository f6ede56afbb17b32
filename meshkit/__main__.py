from meshkit.cli import main

main()
