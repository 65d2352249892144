"""``python -m nbtrain.launcher``: started by the kernel, never by hand."""

from nbtrain.launcher.server import main

main()
