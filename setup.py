"""Only the C extension lives here; everything else about the package is in pyproject.toml."""

from setuptools import Extension, setup

# The row copier is optional: without a C compiler the install goes on and schemas.jagged pads
# rows with numpy instead (same results; unpacking takes about twice as long).
setup(ext_modules=[Extension("schemas._rowcopy", ["schemas/_rowcopy.c"], optional=True)])
