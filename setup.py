"""The one compiled part: the distributed-DP encoding's kernel (device_runtime/_ddp_kernel.c).

Everything else is in pyproject.toml. The extension is optional: where no C compiler is found the
install goes on without it and ``device_runtime.ddp.encode`` runs its numpy path
(``device_runtime.ddp_kernel.load`` says why). The library uses no Python API; ctypes loads it.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "device_runtime._ddp_kernel",
            sources=["device_runtime/_ddp_kernel.c"],
            # -fno-math-errno lets llrint compile to one instruction; the encoding reads each entry
            # as a double and writes it back as an int64 in place (no strict aliasing); no fused
            # multiply-adds, so that a seeded run rounds the same wherever the compiler could use them
            # (a vector argument's ABI note is moot: the vector helpers are all inlined)
            extra_compile_args=["-O3", "-fno-math-errno", "-fno-strict-aliasing", "-ffp-contract=off", "-Wno-psabi"],
            libraries=["m"],
            optional=True,
        )
    ]
)
