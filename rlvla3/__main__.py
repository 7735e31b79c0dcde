"""The program's one entry: ``python -m rlvla3`` and the ``rlvla3`` console script.

A launched process follows its launcher before it imports or starts anything, and a command
that stopped cleanly leaves without the interpreter's teardown (both in rlvla3/lifetime.py)."""

from rlvla3.lifetime import follow_launcher, skip_teardown_after_clean_stop


def entry() -> None:
    follow_launcher()
    skip_teardown_after_clean_stop()
    from rlvla3.app.cli import main  # after follow_launcher: nothing heavy is imported before it

    main()


if __name__ == "__main__":
    entry()
