"""The ``ckptplan`` command line (typer + rich); the app lives in ``ckptplan.cli.main``."""
