"""Build hook (the metadata is in pyproject.toml): ship the default prompt suites in the wheel.

``prompts/`` at the repository root is the canonical, documented location of the prompt suites
(``prompts/README.md``). ``build_py`` copies ``prompts/*.jsonl`` and the schema README into
``specparity/_prompts/`` of the build, so an installed wheel finds them
(``specparity.model.locations.prompt_file``); nothing is copied into the source tree, and an editable
install reads ``prompts/`` itself. A build without the prompt files fails instead of shipping a
wheel whose default suite is missing.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROMPTS = ROOT / "prompts"
PACKAGED = Path("specparity", "_prompts")


def prompt_files() -> list[Path]:
    files = sorted(PROMPTS.glob("*.jsonl"))
    if not (PROMPTS / "default.jsonl") in files:
        raise SystemExit(f"{PROMPTS}/default.jsonl not found: the package would ship without its default prompt suite "
                         "(an sdist must include prompts/, see MANIFEST.in)")
    return files + [p for p in (PROMPTS / "README.md",) if p.is_file()]


class BuildPyWithPrompts(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # the package is the source tree: fixtures.prompt_file reads prompts/ directly
        dest = Path(self.build_lib) / PACKAGED
        self.mkpath(str(dest))
        for src in prompt_files():
            self.copy_file(str(src), str(dest / src.name))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        return outputs + [str(Path(self.build_lib) / PACKAGED / p.name) for p in prompt_files()]


setup(cmdclass={"build_py": BuildPyWithPrompts})
