"""
train.py and sample.py: the command line, bad input, checkpoints and resuming, DDP through torchrun.
Bad input is tested in-process (main raises SystemExit with one line) where a subprocess adds
nothing; the scripts run as subprocesses where the process itself matters (a kill, torchrun, the
exit status and what reaches stderr). Every run writes into its own tmp_path.
"""
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import kernels
import model
import sample
import train
from conftest import (METHODS, ROOT, TINY_TRAIN, assert_clean_error, exit_message, read_train_losses, run_cli)
from model import load_checkpoint, save_checkpoint


# ----------------------------------------------------------------------------- DDP

def assert_torchrun_gives_one_process_losses(tmp_path, args, n_iters):
    """The same run in one process and under torchrun with 2 (gloo): the same loss at every step."""
    single = run_cli('train.py', f'--out_dir={tmp_path / "single"}', *args, cwd=tmp_path)
    assert single.returncode == 0, single.stderr
    ddp = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                          str(ROOT / 'train.py'), f'--out_dir={tmp_path / "ddp"}', *args],
                         cwd=tmp_path, capture_output=True, text=True)
    assert ddp.returncode == 0, ddp.stderr
    expected, got = read_train_losses(tmp_path / 'single' / 'log.jsonl'), read_train_losses(tmp_path / 'ddp' / 'log.jsonl')
    assert set(got) == set(expected) == set(range(1, n_iters + 1))
    for it in expected:
        assert got[it] == pytest.approx(expected[it], abs=1e-5), it


def test_torchrun_two_cpu_processes_give_the_single_process_losses(tmp_path, data_dir):
    """DDP with gloo: 2 processes x 1 micro-step each equal 1 process x 2 micro-steps, step for step."""
    assert_torchrun_gives_one_process_losses(tmp_path, [
        '--dataset=pydoc', f'--data_dir={data_dir}', '--max_iters=6', '--eval_interval=6', '--log_interval=1',
        '--gradient_accumulation_steps=2', '--device=cpu', *TINY_TRAIN], 6)


def test_ddp_ranks_draw_different_batches_that_together_make_one_process_batch():
    gen = lambda: torch.Generator().manual_seed(0)
    single = train.draw_offsets(gen(), 10_000, 32, 4, 3, rank=0, world=1)
    ranks = [train.draw_offsets(gen(), 10_000, 32, 4, 3, rank=r, world=2) for r in (0, 1)]
    assert not torch.equal(ranks[0], ranks[1])
    assert torch.equal(ranks[0], single[0::2]) and torch.equal(ranks[1], single[1::2])



def test_progress_is_a_bar_on_a_terminal_and_plain_lines_in_a_log_file(tmp_path, data_dir, capsys, monkeypatch):
    """A background run's log (stderr not a terminal) gets one plain line per log interval and no
    carriage-return updates; on a terminal the bar stays."""
    args = ['--dataset=pydoc', f'--data_dir={data_dir}', '--max_iters=12', '--eval_interval=12', '--log_interval=4',
            *TINY_TRAIN]
    result = run_cli('train.py', f'--out_dir={tmp_path / "file"}', *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert '\r' not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith('iter ')]
    assert [line.split(':')[0] for line in lines] == ['iter 4/12', 'iter 8/12', 'iter 12/12']
    assert all('loss ' in line and 'tokens/s' in line for line in lines)
    monkeypatch.setattr(sys.stderr, 'isatty', lambda: True)
    train.main([f'--out_dir={tmp_path / "terminal"}', *args])
    err = capsys.readouterr().err
    assert '\r' in err and 'iter 4/12' not in err


# ----------------------------------------------------------------------------- the command line and bad input

def test_bad_input_from_the_shell_is_one_line_without_a_traceback(tmp_path):
    """As a user sees it: a non-zero exit, a last line starting with 'error:', no traceback."""
    result = run_cli('train.py', '--residual=nope', f'--out_dir={tmp_path / "o"}', cwd=tmp_path)
    assert_clean_error(result, 'nope', *METHODS)
    assert not (tmp_path / 'o').exists()
    assert_clean_error(run_cli('train.py', '--residual=mhc_lite', '--hc_streams=7', f'--out_dir={tmp_path / "o"}',
                               cwd=tmp_path), 'hc_streams <= 6', '5040')


def test_unknown_key_suggests_the_right_one():
    message = exit_message(train.main, ['--n_layr=4'])
    assert "'n_layr'" in message and "did you mean 'n_layer'" in message


def test_wrong_type_is_named():
    message = exit_message(train.main, ['--n_layer=abc'])
    assert 'n_layer expects int' in message and "'abc'" in message
    assert 'compile expects bool' in exit_message(train.main, ['--compile=1'])


def test_missing_config_file(tmp_path):
    message = exit_message(train.main, [str(tmp_path / 'no_such_config.py')])
    assert 'no_such_config.py' in message and 'not found' in message


def test_missing_dataset(tmp_path):
    message = exit_message(train.main, ['--dataset=no/such/file.txt', f'--out_dir={tmp_path / "o"}',
                                        f'--data_dir={tmp_path / "d"}'])
    assert 'no/such/file.txt' in message and 'pydoc' in message
    assert not (tmp_path / 'o' / 'ckpt.pt').exists()


def test_missing_checkpoint_on_resume(tmp_path):
    message = exit_message(train.main, ['--init_from=resume', f'--out_dir={tmp_path}'])
    assert 'no checkpoint' in message and str(tmp_path) in message


def test_corrupt_checkpoint_on_resume_is_reported_and_left_untouched(tmp_path):
    ckpt = tmp_path / 'ckpt.pt'
    ckpt.write_bytes(b'PK\x03\x04 this is not a checkpoint')
    message = exit_message(train.main, ['--init_from=resume', f'--out_dir={tmp_path}'])
    assert 'unreadable' in message and str(ckpt) in message
    assert ckpt.read_bytes() == b'PK\x03\x04 this is not a checkpoint'
    assert not (tmp_path / 'log.jsonl').exists()


def test_scratch_run_never_overwrites_an_existing_checkpoint(tmp_path):
    (tmp_path / 'ckpt.pt').write_bytes(b'precious')
    message = exit_message(train.main, [f'--out_dir={tmp_path}'])
    assert 'already exists' in message and '--init_from=resume' in message
    assert (tmp_path / 'ckpt.pt').read_bytes() == b'precious'


def test_config_file_and_overrides_are_type_checked(tmp_path):
    config = tmp_path / 'cfg.py'
    config.write_text('import math\nn_layer = 3\nlearning_rate = 1\ndataset = "text8"\n')
    cfg, given = train.parse_config([str(config), '--n_layer=5', '--out_dir=123'])
    assert cfg['n_layer'] == 5 and cfg['learning_rate'] == 1.0 and isinstance(cfg['learning_rate'], float)
    assert cfg['dataset'] == 'text8' and cfg['out_dir'] == '123'
    assert given == {'n_layer', 'learning_rate', 'dataset', 'out_dir'}


def test_a_scripts_constants_are_not_its_keys():
    """--help lists a script's keys, and only they can be set: its public settings in lower case,
    not its constants in capitals (gpu_suite.py's time limit for the tests was once listed and settable)."""
    import configurator
    assert configurator.keys_of({'steps': 4, 'SUITE_TESTS_S': 120, '_private': 1, 'rate': 0.5, 'f': len}) == \
        {'steps': 4, 'rate': 0.5}


# ----------------------------------------------------------------------------- checkpoints

def test_crash_during_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    path = str(tmp_path / 'ckpt.pt')
    save_checkpoint({'iter_num': 1, 'model': {'w': torch.ones(3)}, 'model_args': {}}, path)
    real_save = torch.save

    def dying_save(obj, f):
        real_save(obj, f)
        f.seek(f.tell() // 2)
        f.truncate()  # half a file written ...
        raise KeyboardInterrupt  # ... and then the process is interrupted
    monkeypatch.setattr(torch, 'save', dying_save)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({'iter_num': 2, 'model': {'w': torch.zeros(3)}, 'model_args': {}}, path)
    ckpt = load_checkpoint(path)
    assert ckpt['iter_num'] == 1 and torch.equal(ckpt['model']['w'], torch.ones(3))


def test_killed_run_resumes_with_the_uninterrupted_losses(tmp_path, data_dir):
    """SIGKILL a run mid-way, resume it, and get exactly the losses of a run that was never
    interrupted. The run starts on one CPU thread (as sweep.py's jobs do) and is resumed from a
    shell with the machine's default: CPU sums depend on the thread count (1 and 2 threads part in
    the last bits within a few steps), so the resumed run must take the checkpoint's."""
    args = ['--dataset=pydoc', f'--data_dir={data_dir}', '--max_iters=120', '--eval_interval=20',
            '--log_interval=1', '--dropout=0.1', '--device=cpu', *TINY_TRAIN]
    one_thread = {**os.environ, 'OMP_NUM_THREADS': '1'}
    whole = run_cli('train.py', f'--out_dir={tmp_path / "whole"}', *args, cwd=tmp_path, env=one_thread)
    assert whole.returncode == 0, whole.stderr
    expected = read_train_losses(tmp_path / 'whole' / 'log.jsonl')

    out = tmp_path / 'killed'
    proc = subprocess.Popen([sys.executable, str(ROOT / 'train.py'), f'--out_dir={out}', *args], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=one_thread)
    while proc.poll() is None and max(read_train_losses(out / 'log.jsonl') if (out / 'log.jsonl').exists()
                                      else {}, default=0) < 50:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, 'the run ended before it could be killed'
    resumed_from = load_checkpoint(str(out / 'ckpt.pt'))['iter_num']
    assert 0 < resumed_from < 120

    env = {k: v for k, v in os.environ.items() if k not in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS')}
    resumed = run_cli('train.py', f'--out_dir={out}', '--init_from=resume', cwd=tmp_path, env=env)  # config from ckpt
    assert resumed.returncode == 0, resumed.stderr
    got = read_train_losses(out / 'log.jsonl')
    assert got == expected  # bit for bit: the same arithmetic, step by step


def test_resume_refuses_to_change_the_model(tmp_path, data_dir):
    train.main([f'--out_dir={tmp_path}', f'--data_dir={data_dir}', '--max_iters=2', '--eval_interval=2', *TINY_TRAIN])
    message = exit_message(train.main, [f'--out_dir={tmp_path}', '--init_from=resume', '--n_layer=3'])
    assert 'n_layer=2' in message and 'cannot change' in message


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, data_dir):
    message = exit_message(train.main, [f'--out_dir={tmp_path}', f'--data_dir={data_dir}', '--max_iters=60',
                                        '--eval_interval=5', *TINY_TRAIN, '--learning_rate=1e12', '--warmup_iters=0',
                                        '--grad_clip=0.0'])
    assert 'loss is' in message and 'nan' in message and 'last good checkpoint' in message
    assert math.isfinite(load_checkpoint(str(tmp_path / 'ckpt.pt'))['val_loss'])


def test_the_loss_is_read_to_the_host_only_at_log_steps(tmp_path, data_dir, monkeypatch):
    """Reading a tensor (.item()) makes the host wait for the device; train.py does so at log steps
    only (the loss and the non-finite flag), not at every step: 20 steps, log_interval 10, no
    evaluation before the end -> 2 reads of each, where a per-step read would make 20."""
    reads, item = [], torch.Tensor.item

    def counted(tensor):
        if sys._getframe(1).f_code.co_filename == train.__file__:
            reads.append(sys._getframe(1).f_lineno)
        return item(tensor)
    monkeypatch.setattr(torch.Tensor, 'item', counted)
    train.main([f'--out_dir={tmp_path}', f'--data_dir={data_dir}', '--max_iters=20', '--log_interval=10',
                '--eval_interval=1000', *TINY_TRAIN])
    assert len(reads) == 4 and len(set(reads)) == 1, reads


def test_sample_prints_text_from_a_trained_checkpoint(tmp_path, data_dir, capsys):
    train.main([f'--out_dir={tmp_path}', f'--data_dir={data_dir}', '--max_iters=20', '--eval_interval=20', *TINY_TRAIN])
    capsys.readouterr()
    args = [f'--out_dir={tmp_path}', '--start=The ', '--num_samples=2', '--max_new_tokens=50', '--seed=3']
    sample.main(args)
    first = capsys.readouterr().out
    samples = first.split('---------------\n')
    assert len(samples) == 3 and all(s.startswith('The ') and len(s) >= 54 for s in samples[:2])
    sample.main(args)
    assert capsys.readouterr().out == first  # the seed makes it reproducible
    assert 'no checkpoint' in exit_message(sample.main, [f'--out_dir={tmp_path / "nothing"}'])


def test_the_readme_ddp_command_runs_with_the_defaults_and_shares_out_the_batch(tmp_path, data_dir):
    """`torchrun --nproc_per_node=2 train.py --device=cpu` with gradient_accumulation_steps=1: each
    process takes half the sequences of the one micro-step, and the losses are one process's."""
    assert_torchrun_gives_one_process_losses(tmp_path, [
        '--dataset=pydoc', f'--data_dir={data_dir}', '--max_iters=4', '--eval_interval=4', '--log_interval=1',
        '--device=cpu', *TINY_TRAIN], 4)
    gen = lambda: torch.Generator().manual_seed(0)
    halves = [train.draw_offsets(gen(), 10_000, 32, 1, 4, rank=r, world=2) for r in (0, 1)]
    assert torch.equal(torch.cat(halves, dim=1)[:, [0, 2, 1, 3]], train.draw_offsets(gen(), 10_000, 32, 1, 4, 0, 1))


def test_an_error_under_torchrun_is_one_line_from_rank_0(tmp_path):
    result = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                             str(ROOT / 'train.py'), '--device=cpu', '--batch_size=3', '--gradient_accumulation_steps=3',
                             f'--out_dir={tmp_path / "o"}'], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode != 0
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith('error:')]
    assert len(errors) == 1 and 'cannot be shared out evenly over 2 processes' in errors[0], result.stderr
    assert 'train.py", line' not in result.stderr  # no traceback of ours (torchrun adds its own report)


@pytest.mark.parametrize('arg,message', [
    ('--batch_size=-1', 'batch_size=-1 is out of range; it must be at least 1'),
    ('--eval_tokens=0', 'eval_tokens=0 is out of range'),
    ('--eval_interval=0', 'eval_interval=0 is out of range'),
    ('--log_interval=0', 'log_interval=0 is out of range'),
    ('--gradient_accumulation_steps=0', 'gradient_accumulation_steps=0 is out of range'),
    ('--eval_tokens=100', 'at least block_size=128'),
    ('--beta2=1.5', 'in [0, 1)'),
    ('--learning_rate=0', 'above 0'),
    ('--mgr_fallback_p=-2', '-1 (no inversion) or at least 0'),
    ('--n_layer=0', 'n_layer must be at least 1'),
    ('--dropout=1.0', 'dropout must be in [0, 1)'),
    ('--init_from=latest', 'scratch or resume'),
    ('--device=gpu', "device='gpu' is not a device"),
    ('--dtype=float16', 'choose one of: auto, float32, bfloat16'),
    ('--residual=kromhc --hc_streams=3', 'hc_streams=3 must be a power of 2'),
    ('--residual=frac --frac_parts=3', 'frac_parts=3 must divide n_embd=128'),
    ('--residual=mgr --mgr_streams=8', 'leaves no keep weight for 8 competing streams'),  # GPTConfig's MGR check
])
def test_every_number_and_choice_is_checked_before_anything_is_written(arg, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert message in exit_message(train.main, [*arg.split(), f'--out_dir={tmp_path / "o"}', f'--data_dir={tmp_path / "d"}'])
    assert not (tmp_path / 'o').exists() and not (tmp_path / 'd').exists()


def test_a_device_this_machine_lacks_is_named_with_the_ones_it_has(tmp_path):
    if torch.cuda.is_available():
        pytest.skip('this machine has CUDA')
    message = exit_message(train.main, ['--device=cuda', f'--out_dir={tmp_path / "o"}'])
    assert "device='cuda' is not available" in message and 'devices here: cpu' in message
    assert not (tmp_path / 'o').exists()


def test_a_broken_config_file_is_named_with_its_line(tmp_path):
    config = tmp_path / 'broken.py'
    config.write_text('n_layer = 3\nlearning_rate = = 2e-3\n')
    assert exit_message(train.main, [str(config)]) == f"error: config file {config}, line 2: invalid syntax"
    config.write_text('n_layer = 3\n\nlearning_rate = 1 / 0\n')
    assert exit_message(train.main, [str(config)]) == (f"error: config file {config}, line 3: "
                                                       f"ZeroDivisionError: division by zero")


def test_an_empty_checkpoint_is_named_and_best_pt_is_mentioned(tmp_path, data_dir):
    train.main([f'--out_dir={tmp_path}', f'--data_dir={data_dir}', '--max_iters=2', '--eval_interval=2', *TINY_TRAIN])
    (tmp_path / 'ckpt.pt').write_bytes(b'')
    for main, args in [(train.main, ['--init_from=resume']), (sample.main, [])]:
        message = exit_message(main, [f'--out_dir={tmp_path}', *args])
        assert message.startswith(f"error: checkpoint {tmp_path / 'ckpt.pt'} is unreadable (it is empty)")
        assert str(tmp_path / 'best.pt') in message and 'weights_only' not in message
    assert (tmp_path / 'ckpt.pt').read_bytes() == b''


def test_a_checkpoint_of_another_model_names_its_settings_and_the_weights_that_differ(tmp_path, data_dir):
    """Weights under another model's settings (WAV's under prenorm's), and a resume whose dataset has
    another vocabulary: the error names the misfit weights and what the checkpoint was trained as."""
    wav = model.GPT(model.GPTConfig(residual='wav', n_layer=2, n_head=2, n_embd=32))
    prenorm_args = vars(model.GPTConfig(residual='prenorm', n_layer=2, n_head=2, n_embd=32)).copy()
    save_checkpoint({'model': wav.state_dict(), 'model_args': prenorm_args}, str(tmp_path / 'ckpt.pt'))
    message = exit_message(sample.main, [f'--out_dir={tmp_path}'])
    assert "residual='prenorm', n_layer=2" in message and 'unexpected: residual.' in message
    assert 'this version of model.py' not in message
    out = tmp_path / 'run'
    train.main([f'--out_dir={out}', f'--data_dir={data_dir}', '--max_iters=2', '--eval_interval=2', *TINY_TRAIN])
    (tmp_path / 'ab.txt').write_text('ab' * 5000)
    message = exit_message(train.main, [f'--out_dir={out}', '--init_from=resume', f'--dataset={tmp_path / "ab.txt"}'])
    trained = load_checkpoint(str(out / 'ckpt.pt'))['model_args']['vocab_size']
    assert "trained as residual='prenorm', n_layer=2" in message and f'vocab_size={trained}' in message
    assert 'of another shape: transformer.wte.weight' in message


def test_a_file_that_is_not_a_whole_checkpoint_says_what_it_is_not(tmp_path):
    """A text file, a truncated checkpoint and another program's torch.save: each named for what it is not."""
    tiny = model.GPT(model.GPTConfig(n_layer=1, n_head=1, n_embd=8))
    save_checkpoint({'model': tiny.state_dict(), 'model_args': vars(tiny.config).copy()}, str(tmp_path / 'whole.pt'))
    whole = (tmp_path / 'whole.pt').read_bytes()
    (tmp_path / 'text.pt').write_text('iter 100: val_loss 1.31\n')
    (tmp_path / 'cut.pt').write_bytes(whole[:len(whole) // 2])
    torch.save({'weights': torch.zeros(2)}, str(tmp_path / 'other.pt'))
    for name, expected in [('text.pt', 'not a checkpoint of this project'), ('cut.pt', 'a truncated file'),
                           ('other.pt', 'not a checkpoint of this project')]:
        message = exit_message(sample.main, [f'--out_dir={tmp_path}', f'--ckpt_name={name}'])
        assert expected in message and 'Error' not in message, message


def test_ctrl_c_says_where_the_last_checkpoint_is_and_how_to_resume(tmp_path, data_dir):
    out = tmp_path / 'run'
    args = ['--dataset=pydoc', f'--data_dir={data_dir}', '--max_iters=100000', '--eval_interval=5', '--log_interval=1',
            f'--out_dir={out}', *TINY_TRAIN]
    # a shell's background job (CI launched with `&`, nohup) ignores SIGINT, and its children inherit that:
    # give the run the default, as in a terminal, so that the signal arrives
    proc = subprocess.Popen([sys.executable, str(ROOT / 'train.py'), *args], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    while proc.poll() is None and max(read_train_losses(out / 'log.jsonl') if (out / 'log.jsonl').exists()
                                      else {}, default=0) < 7:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    try:
        _, stderr = proc.communicate(timeout=600)  # it stops within a step; minutes only on a crawling machine
    finally:
        proc.kill()
    assert proc.returncode == 130 and 'Traceback' not in stderr, stderr
    saved = load_checkpoint(str(out / 'ckpt.pt'))['iter_num']
    line = stderr.strip().splitlines()[-1]
    assert f"the last checkpoint, {out / 'ckpt.pt'}, is from iter {saved}" in line
    assert f"python train.py --out_dir={out} --init_from=resume" in line


def test_a_resumed_log_tells_one_history(tmp_path, data_dir):
    """The rows a killed run wrote past its last checkpoint are dropped on resume, so every
    iteration appears once, with the losses of the resumed run."""
    train.main([f'--out_dir={tmp_path}', f'--data_dir={data_dir}', '--eval_interval=4', '--log_interval=1',
                '--max_iters=6', *TINY_TRAIN])  # its last checkpoint: iter 6
    log = tmp_path / 'log.jsonl'
    killed_rows = ''.join(json.dumps({'iter': it, 'loss': -1.0}) + '\n' for it in (7, 8)) + '{"iter": 9, "lo'
    log.write_text(log.read_text().replace('{"event": "done"', '{"event": "killed"') + killed_rows)
    train.main(['--init_from=resume', f'--out_dir={tmp_path}', '--max_iters=8'])
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r['iter'] for r in rows if 'loss' in r] == list(range(1, 9))
    assert all(r['loss'] > 0 for r in rows if 'loss' in r)  # the resumed run's, not the killed run's
    assert [r['iter'] for r in rows if 'val_loss' in r and 'event' not in r] == [0, 4, 6, 8]
    assert [r['event'] for r in rows if 'event' in r] == ['start', 'killed', 'resume', 'done']


def test_tokens_per_second_counts_training_steps_only(tmp_path, data_dir, monkeypatch):
    """An evaluation that takes 2 s does not lower the logged tokens/s of the steps around it."""
    import data
    real_evaluate = data.evaluate

    def slow_evaluate(*args):
        time.sleep(2.0)
        return real_evaluate(*args)
    monkeypatch.setattr(data, 'evaluate', slow_evaluate)
    train.main([f'--out_dir={tmp_path}', f'--data_dir={data_dir}', '--max_iters=4', '--eval_interval=2',
                '--log_interval=4', '--batch_size=2', *TINY_TRAIN[:4]])
    rate = [json.loads(line) for line in open(tmp_path / 'log.jsonl') if '"tokens_per_s"' in line][0]['tokens_per_s']
    assert rate > 4 * 2 * 32 / 2.0  # the 4 steps' 256 tokens took far less than the 2 s evaluation


def test_wandb_gets_what_the_log_gets(tmp_path, data_dir, monkeypatch):
    calls = []
    fake = type(sys)('wandb')
    fake.init = lambda **kwargs: calls.append(('init', kwargs))
    fake.log = lambda record, step: calls.append(('log', step, record))
    fake.finish = lambda: calls.append(('finish',))
    monkeypatch.setitem(sys.modules, 'wandb', fake)
    train.main([f'--out_dir={tmp_path / "run7"}', f'--data_dir={data_dir}', '--max_iters=4', '--eval_interval=2',
                '--log_interval=2', '--wandb_log=True', '--wandb_project=p', *TINY_TRAIN])
    assert calls[0][0] == 'init' and calls[0][1]['project'] == 'p' and calls[0][1]['name'] == 'run7'
    assert calls[0][1]['config']['max_iters'] == 4 and calls[-1] == ('finish',)
    logged = {(step, key) for _, step, record in (c for c in calls if c[0] == 'log') for key in record}
    assert {(2, 'loss'), (2, 'val_loss'), (4, 'val_bpc'), (4, 'tokens_per_s')} <= logged
    monkeypatch.setitem(sys.modules, 'wandb', None)  # not installed
    assert 'pip install wandb' in exit_message(train.main, [f'--out_dir={tmp_path / "x"}', f'--data_dir={data_dir}',
                                                           '--wandb_log=True', *TINY_TRAIN])


def test_compile_says_that_it_compiles_and_passes_the_mode_through(tmp_path, data_dir, capsys, monkeypatch):
    modes = []  # the message and the options, not the compiler, are under test
    monkeypatch.setattr(torch, 'compile', lambda model, mode: modes.append(mode) or model)
    train.main([f'--out_dir={tmp_path}', f'--data_dir={data_dir}', '--max_iters=1', '--eval_interval=1',
                '--compile=True', '--compile_mode=reduce-overhead', *TINY_TRAIN])
    assert 'compiling the model with torch.compile' in capsys.readouterr().err and modes == ['reduce-overhead']
    compiled = []
    monkeypatch.setattr(model.GPT, 'compile_sublayers', lambda self, mode: compiled.append(mode))
    train.main([f'--out_dir={tmp_path / "regional"}', f'--data_dir={data_dir}', '--max_iters=1', '--eval_interval=1',
                '--compile=True', '--compile_scope=sublayers', *TINY_TRAIN])
    assert 'compiling each sublayer' in capsys.readouterr().err and compiled == ['default']
    assert 'model or sublayers' in exit_message(train.main, ['--compile_scope=blocks'])
    assert 'default or reduce-overhead or max-autotune' in exit_message(train.main, ['--compile_mode=fast'])


@pytest.mark.skipif(kernels.triton is None, reason='triton is not installed (pip install triton; Linux)')
def test_the_gpu_suite_runs_dry_on_a_cpu(tmp_path):
    """gpu_suite.py, prepared for a lent GPU, runs the same steps tiny on a CPU: a few kernel tests,
    the eager and decode benchmarks through the Triton interpreter, its JSON and markdown table; and it
    refuses to start for real without a GPU."""
    import gpu_suite
    if not torch.cuda.is_available():
        assert 'needs a CUDA GPU' in exit_message(gpu_suite.main, [f'--out_dir={tmp_path}'])
    suite = gpu_suite.main(['--dry_run=True', f'--out_dir={tmp_path}'])
    assert 'passed' in suite['tests'] and 'failed' not in suite['tests']
    assert suite['runs']['eager']['status'] == 'done' and suite['runs']['compiled']['status'].startswith('not run')
    assert [r['method'] for r in suite['runs']['eager']['results']] == ['prenorm', 'block_attnres', 'mgr']
    assert suite['runs']['decode']['status'] == 'done' and suite['runs']['decode']['results'][2]['ratio'] > 0
    table = (tmp_path / 'suite.md').read_text()
    assert 'torch ' + torch.__version__ in table and '| mgr |' in table
    assert json.loads((tmp_path / 'suite.json').read_text())['config'] == 'tiny'


@pytest.mark.parametrize('script', ['train.py', 'sample.py', 'bench.py', 'gpu_suite.py', 'analyze.py', 'sweep.py',
                                    'data.py'])
def test_every_script_answers_help(script, tmp_path):
    result = run_cli(script, '--help', cwd=tmp_path)
    assert result.returncode == 0 and f'python {script}' in result.stdout, result.stdout + result.stderr
    assert not list(tmp_path.iterdir())


def test_the_tools_check_their_numbers():
    import analyze
    import bench
    assert 'steps=0 is out of range' in exit_message(bench.main, ['--steps=0'])
    assert 'temperature=0.0 is out of range' in exit_message(sample.main, ['--temperature=0'])
    assert 'batch_size=0 is out of range' in exit_message(analyze.main, ['--batch_size=0'])


def test_bench_runs_each_method_beside_its_own_prenorm(tmp_path):
    """bench.py runs every method in a process of its own with a prenorm beside it, and reports
    each ratio against that prenorm; in one process (--isolate=False) the models and the saved
    bytes are the same (they do not depend on the process)."""
    import bench
    args = ['--config=tiny', '--methods=wav,hc', '--steps=1', '--warmup=0']
    isolated = bench.main([*args, f'--json_path={tmp_path / "isolated.json"}'])
    together = bench.main([*args, '--isolate=False'])
    assert [r['method'] for r in isolated] == [r['method'] for r in together] == ['prenorm', 'wav', 'hc']
    assert len(isolated[0]['step_ms_each']) == 2 and isolated[0]['step_ms'] in isolated[0]['step_ms_each']
    assert [r['saved_mb'] for r in isolated] == [r['saved_mb'] for r in together]
    assert all(r['params'] == t['params'] and r['step_ms'] > 0 for r, t in zip(isolated, together))
    assert isolated[1]['saved_ratio'] > 1 and isolated[0]['ratio'] == 1.0
    with open(tmp_path / 'isolated.json') as f:
        assert json.load(f)['results'] == isolated


def test_bench_takes_every_methods_knobs_and_checks_them_first():
    """bench.py takes GPTConfig's method knobs (--hc_streams=8 reaches every HC model, in the isolated
    processes too: more streams, more parameters), and a bad value, a GPTConfig check or a class's
    own, is one line before anything runs."""
    import bench
    args = ['--config=tiny', '--methods=hc,laurel_lr', '--steps=1', '--warmup=0']
    default, wider = bench.main(args), bench.main([*args, '--hc_streams=8', '--laurel_rank=2'])
    params = lambda results: {r['method']: r['params'] for r in results}
    assert params(wider)['hc'] > params(default)['hc'] and params(wider)['laurel_lr'] < params(default)['laurel_lr']
    assert params(wider)['prenorm'] == params(default)['prenorm']
    assert 'must be a power of 2' in exit_message(bench.main, ['--methods=kromhc', '--hc_streams=6'])
    assert 'needs more than 7 sublayers' in exit_message(bench.main, ['--config=tiny', '--methods=mgr', '--mgr_streams=8'])
    assert "unknown key 'hc_stream'" in exit_message(bench.main, ['--hc_stream=8'])


def test_bench_times_a_config_at_another_depth():
    """--n_layer replaces the config's depth (the depth study's step times, one depth at a time): one
    more layer is one more block's parameters; 0 keeps the config's."""
    import bench
    from model import GPT, GPTConfig
    args = ['--config=tiny', '--methods=prenorm', '--steps=1', '--warmup=0']
    tiny = {k: v for k, v in bench.CONFIGS['tiny'].items() if k != 'batch_size'}
    size = lambda n: GPT(GPTConfig(**dict(tiny, n_layer=n), vocab_size=bench.vocab_size)).get_num_params()
    block = size(2) - size(1)
    params = [bench.main([*args, f'--n_layer={n}'])[0]['params'] for n in (0, 3)]
    assert params[1] - params[0] == (3 - tiny['n_layer']) * block and block > 0
    assert "n_layer=-1 is out of range" in exit_message(bench.main, ['--config=tiny', '--n_layer=-1'])
