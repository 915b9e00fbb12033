"""``python -m worldloop ...`` is the ``worldloop`` command."""

from worldloop.cli import run

if __name__ == "__main__":
    run()
