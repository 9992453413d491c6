"""Packaging that pyproject.toml cannot declare: the repository's `recipes/` folder ships inside the
package as `attnres_convert/recipes` (package data of a wheel), so the checkout keeps one real copy."""

from setuptools import find_packages, setup

RECIPES = ["attnres_convert.recipes", "attnres_convert.recipes.accelerate"]

setup(
    packages=find_packages(include=["attnres_convert", "attnres_convert.*"]) + RECIPES,
    package_dir={"attnres_convert.recipes": "recipes"},
    package_data={
        "attnres_convert.kernels": ["*.cpp"],
        "attnres_convert.recipes": ["*.yaml"],
        "attnres_convert.recipes.accelerate": ["*.yaml"],
    },
)
