"""``python -m deqscore.bench``: see :mod:`deqscore.bench`."""

from . import main

if __name__ == "__main__":
    main()
