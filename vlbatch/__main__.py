from vlbatch.cli import main

main()
