"""The command line's two doors: ``python -m backend`` from a checkout, and the ``kvlens`` command that
``pip install`` puts on the path (pyproject.toml's ``[project.scripts]``). Both check the settings first, then
run ``cli.main``."""
import sys

from .environment import SettingError, check_environment


def main(prog: str = "kvlens") -> int:
    """The command line on ``sys.argv``, its help and messages naming it ``prog``; the exit status."""
    try:  # before anything reads a setting (backend.api reads the limits on import)
        check_environment()
    except SettingError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from .cli import main as run_command

    return run_command(prog=prog)


if __name__ == "__main__":
    sys.exit(main("python -m backend"))
