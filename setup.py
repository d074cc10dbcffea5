"""rllib-dreamerv3: DreamerV3 in TensorFlow 2 as an algorithm plugin for Ray RLlib 2.60."""

from setuptools import find_packages, setup

setup(
    name="rllib-dreamerv3",
    version="0.1.0",
    description="DreamerV3 (TensorFlow 2) for Ray RLlib's new API stack",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["rllib_dreamerv3", "rllib_dreamerv3.*"]),
    python_requires=">=3.10",
    install_requires=[
        "ray[rllib]==2.60.0",
        "tensorflow==2.21.0",
        "tensorflow-probability==0.25.0",
        "tf-keras==2.21.0",
        "gymnasium==1.2.2",
        "ale-py>=0.10",
        "opencv-python-headless",  # gymnasium's AtariPreprocessing resizes with cv2; dream media
        "numpy>=1.26",
        "pyyaml",
        "tqdm",  # progress bars for the warm-up and `rllib evaluate`
        "tensorboardX",  # Ray Tune writes TensorBoard logs only with it
        "pillow>=10",  # tensorboardX encodes images (the dreams) with it
    ],
    extras_require={
        "test": ["pytest>=8", "ruff==0.17.6"],
        "video": ["moviepy"],
        "plot": ["matplotlib"],  # benchmarks/plot_learning.py
        # DeepMind Control tasks, "DMC/<domain>-<task>" (rllib_dreamerv3.envs.dmc)
        "dmc": ["shimmy[dm-control]==2.0.1", "dm-control==1.0.52"],
        # RLlib's torch DreamerV3, the baseline of benchmarks/*_speed.py
        "bench": ["torch==2.13.0"],
    },
    # Ray 2.60 ships no `rllib` command; `rllib-dreamerv3` is the same program under a name no
    # other package claims (the CLI warns when another installed package declares `rllib`).
    entry_points={
        "console_scripts": [
            "rllib = rllib_dreamerv3.cli:main",
            "rllib-dreamerv3 = rllib_dreamerv3.cli:main",
        ]
    },
)
