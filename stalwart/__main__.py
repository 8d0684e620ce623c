"""``python -m stalwart``: the same as the ``stalwart`` command."""

from stalwart._entry import main

main()
