"""`python -m expresslane.cli`: the `expresslane` command."""

import sys

from expresslane.cli.main import main

sys.exit(main())
