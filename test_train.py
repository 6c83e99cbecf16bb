"""
train.py and sample.py: the command line, bad input, checkpoints and resuming, DDP through torchrun.
Bad input is tested in-process (main raises SystemExit with one line) where a subprocess adds
nothing; the scripts run as subprocesses where the process itself matters (a kill, torchrun, the
exit status and what reaches stderr). Every run writes into its own tmp_path.
"""
import math
import signal
import subprocess
import sys
import time

import pytest
import torch

import sample
import train
from conftest import (METHODS, ROOT, TINY_TRAIN, assert_clean_error, exit_message, read_train_losses, run_cli)
from model import load_checkpoint, save_checkpoint


# ----------------------------------------------------------------------------- DDP

def test_torchrun_two_cpu_processes_give_the_single_process_losses(tmp_path, data_dir):
    """DDP with gloo: 2 processes x 1 micro-step each equal 1 process x 2 micro-steps, step for step."""
    args = ['--dataset=pydoc', f'--data_dir={data_dir}', '--max_iters=6', '--eval_interval=6', '--log_interval=1',
            '--gradient_accumulation_steps=2', '--device=cpu', *TINY_TRAIN]
    single = run_cli('train.py', f'--out_dir={tmp_path / "single"}', *args, cwd=tmp_path)
    assert single.returncode == 0, single.stderr
    ddp = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                          str(ROOT / 'train.py'), f'--out_dir={tmp_path / "ddp"}', *args],
                         cwd=tmp_path, capture_output=True, text=True)
    assert ddp.returncode == 0, ddp.stderr
    expected, got = read_train_losses(tmp_path / 'single' / 'log.jsonl'), read_train_losses(tmp_path / 'ddp' / 'log.jsonl')
    assert set(got) == set(expected) == set(range(1, 7))
    for it in expected:
        assert got[it] == pytest.approx(expected[it], abs=1e-5), it


def test_ddp_ranks_draw_different_batches_that_together_make_one_process_batch():
    gen = lambda: torch.Generator().manual_seed(0)
    single = train.draw_offsets(gen(), 10_000, 32, 4, 3, rank=0, world=1)
    ranks = [train.draw_offsets(gen(), 10_000, 32, 4, 3, rank=r, world=2) for r in (0, 1)]
    assert not torch.equal(ranks[0], ranks[1])
    assert torch.equal(ranks[0], single[0::2]) and torch.equal(ranks[1], single[1::2])


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


# ----------------------------------------------------------------------------- checkpoints

def test_crash_during_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    path = str(tmp_path / 'ckpt.pt')
    save_checkpoint({'iter_num': 1, 'w': torch.ones(3)}, path)
    real_save = torch.save

    def dying_save(obj, f):
        real_save(obj, f)
        f.seek(f.tell() // 2)
        f.truncate()  # half a file written ...
        raise KeyboardInterrupt  # ... and then the process is interrupted
    monkeypatch.setattr(torch, 'save', dying_save)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({'iter_num': 2, 'w': torch.zeros(3)}, path)
    ckpt = load_checkpoint(path)
    assert ckpt['iter_num'] == 1 and torch.equal(ckpt['w'], torch.ones(3))


def test_killed_run_resumes_with_the_uninterrupted_losses(tmp_path, data_dir):
    """SIGKILL a run mid-way, resume it, and get the losses of a run that was never interrupted."""
    args = ['--dataset=pydoc', f'--data_dir={data_dir}', '--max_iters=300', '--eval_interval=40',
            '--log_interval=1', '--dropout=0.1', *TINY_TRAIN]
    whole = run_cli('train.py', f'--out_dir={tmp_path / "whole"}', *args, cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    expected = read_train_losses(tmp_path / 'whole' / 'log.jsonl')

    out = tmp_path / 'killed'
    proc = subprocess.Popen([sys.executable, str(ROOT / 'train.py'), f'--out_dir={out}', *args], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None and max(read_train_losses(out / 'log.jsonl') if (out / 'log.jsonl').exists()
                                      else {}, default=0) < 130:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, 'the run ended before it could be killed'
    resumed_from = load_checkpoint(str(out / 'ckpt.pt'))['iter_num']
    assert 0 < resumed_from < 300

    resumed = run_cli('train.py', f'--out_dir={out}', '--init_from=resume', cwd=tmp_path)  # config from ckpt
    assert resumed.returncode == 0, resumed.stderr
    got = read_train_losses(out / 'log.jsonl')  # later lines (the resumed run) win
    assert set(got) == set(expected)
    for it in expected:
        assert got[it] == pytest.approx(expected[it], rel=1e-6, abs=1e-7), it


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
