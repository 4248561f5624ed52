import sys

from .environment import SettingError, check_environment

try:  # before anything reads a setting (backend.api reads the limits on import)
    check_environment()
except SettingError as err:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)

from .cli import main  # noqa: E402

sys.exit(main())
