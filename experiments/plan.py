"""`jaxcnn plan` under its old name: plan a layout before renting the cluster (see --help)."""

from jaxcnn.commands import cli
from jaxcnn.commands.plan import PROG, main

if __name__ == "__main__":
    cli.run_main(PROG, main)
