"""One module per `soap` subcommand: `add_parser(subparsers)` and `run(args) -> int`."""
