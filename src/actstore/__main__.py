"""``python -m actstore`` runs the command-line interface."""

from .cli import main

main()
