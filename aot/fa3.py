"""FlashAttention-3: loaded from the kernels Hub or an importable module, and handed to diffusers'
`_flash_3` attention backend, which exported blocks call through its registered custom op."""

from __future__ import annotations

import functools
import importlib
from typing import Any

# kernels-community/flash-attn3's major version: the one diffusers 0.42 pins for its FA3 backend.
FA3_KERNEL_VERSION = 1


@functools.cache
def load_fa3(source: str) -> Any:
    """Load FlashAttention-3 and hand it to diffusers' `_flash_3` attention backend.

    `source` is a Hub kernel repo (`owner/name`, fetched by `kernels.get_kernel` at
    `FA3_KERNEL_VERSION`) or the name of an importable module providing `flash_attn_func`
    (e.g. `fa3_fwd_interface` from the PyPI wheel `fa3-fwd`). The backend calls it through the
    registered custom op `_diffusers_flash_attn_3::_flash_attn_forward`, which has a fake
    implementation, so a block exports as one graph and the package calls that op at run time.

    Loads once per process (a failed load is tried again at the next call).

    Raises:
        ImportError, OSError, RuntimeError: the kernel cannot be found or loaded.
    """
    from diffusers.models import attention_dispatch  # heavy: at first use

    if "/" in source:
        from kernels import get_kernel  # at first use: only a Hub kernel needs it

        module = get_kernel(source, version=FA3_KERNEL_VERSION)
    else:
        module = importlib.import_module(source)
    # diffusers looks for FA3 only once, as a module named `flash_attn_interface` at its import;
    # these two names are what that detection sets.
    attention_dispatch.flash_attn_3_func = module.flash_attn_func
    attention_dispatch._CAN_USE_FLASH_ATTN_3 = True
    return module
