"""``python -m traceclf``: the same command as the ``traceclf`` console script."""

from traceclf.cli import main

if __name__ == "__main__":
    main()
