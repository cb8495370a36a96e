import sys

from .interrupt import exits_on_interrupt

with exits_on_interrupt():
    from .cli import console

sys.exit(console())
