"""``python -m hpcelastic`` is the same as the ``hpcelastic`` console script."""

from hpcelastic.cli import main

if __name__ == "__main__":
    main()
