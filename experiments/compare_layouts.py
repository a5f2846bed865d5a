"""`jaxcnn compare` under its old name: compare layouts from the compiled program (see --help)."""

from jaxcnn.commands import cli
from jaxcnn.commands.compare import PROG, main

if __name__ == "__main__":
    cli.run_main(PROG, main)
