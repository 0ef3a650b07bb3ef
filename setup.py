"""Packaging for dflash_nb: metadata and requirements come from settings.ini (nbdev 2)."""
from configparser import ConfigParser
from setuptools import find_packages, setup

cfg = ConfigParser(delimiters=["="])
cfg.read("settings.ini")
cfg = cfg["DEFAULT"]

setup(
    name=cfg["lib_name"],
    version=cfg["version"],
    description=cfg["description"],
    author=cfg["author"],
    license=cfg["license"],
    python_requires=">=" + cfg["min_python"],
    # the Triton kernel source lives in the top-level kernels/ folder, reached as dflash_nb.kernels through the
    # symlink dflash_nb/kernels; kernels/ has no __init__.py, so it never shadows the `kernels` distribution
    # (Hugging Face's, which transformers imports) for a python started in the project root
    packages=find_packages(include=["dflash_nb", "dflash_nb.*"]) + ["dflash_nb.kernels"],
    package_data={"dflash_nb": ["demo_data/*"]},
    include_package_data=True,
    install_requires=cfg.get("requirements", "").split(),
    extras_require={"dev": cfg.get("dev_requirements", "").split(),
                    "gpu": cfg.get("gpu_requirements", "").split(),  # fla wheels; causal-conv1d optional
                    "gguf": cfg.get("gguf_requirements", "").split()},  # reading GGUF files (SmolLM2 as a target)
    entry_points={"console_scripts": cfg.get("console_scripts", "").split(),   # dflash-data, dflash-train, ...
                  "nbdev": [f"{cfg['lib_name']}={cfg['lib_name']}._modidx:d"]},
    zip_safe=False,
)
