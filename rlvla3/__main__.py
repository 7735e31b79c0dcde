from rlvla3.cli import main

main()
