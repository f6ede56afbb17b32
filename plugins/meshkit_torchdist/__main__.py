"""``torchrun ... -m meshkit_torchdist CONFIG``: see :mod:`meshkit_torchdist.launch`."""

from __future__ import annotations

from meshkit_torchdist.launch import exit_now, main

exit_now(main())
