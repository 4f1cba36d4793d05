"""zmrl's Hydra configs for verl (zmrl_ppo.yaml). `python -m zmrl.verl.config` prints this
folder, for `python -m verl.trainer.main_ppo --config-path=... --config-name=zmrl_ppo`."""
from pathlib import Path

DIR = str(Path(__file__).resolve().parent)
