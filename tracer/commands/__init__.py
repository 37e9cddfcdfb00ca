"""One module per subcommand, plus args.py, the argument types they share
(rank 6: imports every stage below; cli.py, rank 7, imports them)."""
