"""``python -m deqlab``: see :mod:`deqlab`."""

from . import main

if __name__ == "__main__":
    main()
