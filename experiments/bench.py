"""`jaxcnn bench` under its old name: benchmark one train step (see --help)."""

from jaxcnn.commands import cli
from jaxcnn.commands.bench import PROG, main

if __name__ == "__main__":
    cli.run_main(PROG, main)
