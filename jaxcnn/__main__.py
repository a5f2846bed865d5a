"""`python -m jaxcnn ...`: the jaxcnn command (where its script is not on PATH)."""

from jaxcnn.commands import main

main()
