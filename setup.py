"""Packaging: one top-level package, ``weightsync``; its three layers live at the repository's top.

``engine/``, ``roles/`` and ``wire/`` are installed as ``weightsync.engine``, ``weightsync.roles`` and
``weightsync.wire`` (``package_dir``), so site-packages gains ``weightsync`` and nothing else.
"""

from setuptools import find_packages, setup

LAYERS = ("engine", "roles", "wire")

packages = ["weightsync"] + [f"weightsync.{name}" for layer in LAYERS
                             for name in find_packages(include=[layer, f"{layer}.*"])]
package_dir = {"weightsync": "weightsync", **{f"weightsync.{layer}": layer for layer in LAYERS}}

setup(packages=packages, package_dir=package_dir)
