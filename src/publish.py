"""The upload of a run's model, with its model card, to the Hugging Face Hub.

    python -m src.publish results/<run_name>                            # (re)write the model card(s)
    python -m src.publish results/<run_name> --hub_model_id ORG/NAME    # and push (e.g. a run trained offline)

The card itself (`README.md` beside the final model) is src/reporting/model_card.py's.

The push is the toolkit's, not Trainer's (TRL's `push_to_hub` stays off): one upload after the final save, the judge
and the card, from rank 0, of the adapter (or full model) to --hub_model_id and of the merged model to
`<hub_model_id>-merged` — a repository of its own, so `from_pretrained(repo)` loads either without a subfolder.
Trainer's push would create the repository when the trainer is built (failing an offline run before it trains),
upload every checkpoint from a background thread, and write a card that knows nothing of the judged results.

Nothing damaged is published: each saved model directory is verified against the manifest its save recorded
(src/run_safety/checkpoint_manifest.py) before it is pushed or copied out (`damaged_model`); a damaged one is refused
in one line, exit status 8 (ExitStatus.DAMAGED). The manifest itself (`.complete`) is not uploaded.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from src.hub_access import hub_reachable, is_offline
from src.resource_limits import usable_cores
from src.run_safety.build_once import COMPLETE_MARKER
from src.run_safety.checkpoint_manifest import verify
from src.run_safety.exit_status import ExitStatus
from src.reporting.model_card import CARD, MERGED_SUFFIX, model_dirs, write_model_cards  # noqa: F401 (src/pipeline/ imports them from here)
from src.run_files import TRAINING_INFO, read_json


class PublishError(Exception):
    """The model could not be pushed (no token, Hub unreachable, refused); the message says why in one line."""


def push_problem() -> str | None:
    """Why a push would fail right now (no token, offline, Hub unreachable), or None. Asked before training too."""
    from huggingface_hub import get_token

    if get_token() is None:
        return "no Hugging Face token: set HF_TOKEN (or run `hf auth login`)"
    if is_offline():
        return "the Hub is switched off for this process (HF_HUB_OFFLINE=1, set when it was unreachable at start)"
    if not hub_reachable():
        return "cannot reach the Hugging Face Hub (huggingface.co, or HF_ENDPOINT)"
    return None


def damaged_model(run_dir: str | Path) -> str | None:
    """The line that refuses to publish the run's saved model when a directory of it (the final model, the merged
    copy) is not what its save recorded; None when each is intact or was saved before manifests. Costs one read of
    them, on every core."""
    run_dir = Path(run_dir)
    for directory in model_dirs(run_dir, read_json(run_dir / TRAINING_INFO)).values():
        problem = verify(directory, usable_cores())
        if problem:
            return f"{directory} is damaged ({problem}): restore it from a copy, or train it again (--overwrite)"
    return None


def push_to_hub(run_dir: str | Path, hub_model_id: str, private: bool | None = None) -> dict[str, str]:
    """Upload the final model (and the merged copy) with their cards; returns {repo id: repo URL}. The token is
    huggingface_hub's own (HF_TOKEN or a cached login): the toolkit never reads it into anything it writes."""
    from huggingface_hub import HfApi

    problem = push_problem()
    if problem:
        raise PublishError(problem)
    dirs = write_model_cards(run_dir, hub_model_id)
    if "final" not in dirs:
        raise PublishError(f"{run_dir} holds no saved final model (model/final/): nothing to push")
    info = read_json(Path(run_dir) / TRAINING_INFO)
    uploads = {hub_model_id: dirs["final"]} | (
        {hub_model_id + MERGED_SUFFIX: dirs["merged"]} if "merged" in dirs else {})
    api = HfApi()
    pushed = {}
    for repo_id, folder in uploads.items():
        try:
            url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
            api.upload_folder(repo_id=repo_id, repo_type="model", folder_path=str(folder),
                              ignore_patterns=[COMPLETE_MARKER],
                              commit_message=f"prefkit {info.get('stage', '')} run {info.get('run_name', '')}")
        except Exception as error:  # any client or network failure: the run is saved, say why it was not pushed
            detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise PublishError(f"{repo_id}: {detail}") from None
        pushed[repo_id] = str(url)
    return pushed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m src.publish", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory, e.g. results/<run_name>")
    parser.add_argument("--hub_model_id", help="push to this Hub repository (ORG/NAME) after writing the cards")
    parser.add_argument("--hub_private_repo", action="store_true", help="create the repository private")
    args = parser.parse_args(argv)
    if not (Path(args.run_dir) / TRAINING_INFO).exists():
        print(f"error: {args.run_dir} has no {TRAINING_INFO}: not a finished prefkit run directory", file=sys.stderr)
        return 1
    if not args.hub_model_id:
        written = write_model_cards(args.run_dir)
        for directory in written.values():
            print(f"model card: {directory / CARD}")
        if not written:
            print(f"error: {args.run_dir} holds no saved final model (model/final/)", file=sys.stderr)
        return 0 if written else 1
    damaged = damaged_model(args.run_dir)
    if damaged:
        print(f"error: not pushed: {damaged}", file=sys.stderr)
        return ExitStatus.DAMAGED
    try:
        pushed = push_to_hub(args.run_dir, args.hub_model_id, args.hub_private_repo or None)
    except PublishError as error:
        print(f"error: not pushed: {error}", file=sys.stderr)
        return 1
    for url in pushed.values():
        print(f"pushed: {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
