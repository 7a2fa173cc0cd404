"""``python -m leasekeeper``: the ``leasekeeper`` command."""

from leasekeeper.cli import main

if __name__ == "__main__":
    main()
