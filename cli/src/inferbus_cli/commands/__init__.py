"""One module per `inferbus` subcommand; each exposes ``run(args) -> exit code``."""
