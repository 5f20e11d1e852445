"""Declares the host_index C extension; all metadata lives in setup.cfg."""
import setuptools

setuptools.setup(ext_modules=[])
