"""Where this pytest process runs the Triton kernels (see tests/conftest.py for the two processes).

DEVICE is the device of the tests marked both `gpu` and `interpreter`: "cpu" (Triton kernels
under the interpreter) in the interpreter process, "cuda" in the main process, which runs those
tests only where CUDA is.
"""

import torch

from longctx.backend import interpreter_active

INTERPRET = interpreter_active()
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cpu" if INTERPRET else "cuda"
