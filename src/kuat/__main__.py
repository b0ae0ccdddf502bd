"""``python -m kuat ...``: the ``kuat`` command (:func:`kuat.cli.main`)."""

if __name__ == "__main__":
    from kuat.cli import main

    raise SystemExit(main())
