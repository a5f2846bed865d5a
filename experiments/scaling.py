"""`jaxcnn scale` under its old name: the scaling report (see --help)."""

from jaxcnn.commands import cli
from jaxcnn.commands.scale import PROG, main

if __name__ == "__main__":
    cli.run_main(PROG, main)
