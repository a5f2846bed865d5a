"""`jaxcnn train` under its old name: train a CNN under a layout and mesh (see --help)."""

from jaxcnn.commands import cli
from jaxcnn.commands.train import PROG, main

if __name__ == "__main__":
    cli.run_main(PROG, main)
