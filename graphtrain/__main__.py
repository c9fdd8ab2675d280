from graphtrain.cli import main

main()
