"""Weak references and locks travel through our pickler as what they mean in the loading process."""

from __future__ import annotations

import pickle
import queue
import threading
import weakref

import pytest

from nbtrain.messages import codepickle


class _Holder:
    def method(self) -> _Holder:
        return self


def _round_trip(obj: object) -> object:
    return pickle.loads(codepickle.dumps_keeping_filenames(obj))


def test_a_weak_reference_arrives_pointing_at_the_arriving_referent_and_a_dead_one_dead():
    holder, gone = _Holder(), _Holder()
    holder.me, holder.weak_method = weakref.ref(holder), weakref.WeakMethod(holder.method)
    holder.gone = weakref.ref(gone)
    del gone
    copy = _round_trip(holder)
    assert copy.me() is copy and copy.gone() is None
    assert copy.weak_method()() is copy


def test_a_weak_reference_keeps_its_callback():
    referent, called = _Holder(), []
    holder = _Holder()
    holder.referent, holder.called = referent, called
    holder.ref = weakref.ref(referent, called.append)
    copy = _round_trip(holder)
    del copy.referent  # the arriving referent's last holder: the arriving callback runs
    assert copy.ref() is None and copy.called == [copy.ref]


def test_weak_containers_keep_their_living_items():
    keys, values = [_Holder(), _Holder()], [_Holder()]
    sent = [keys, values, weakref.WeakKeyDictionary({keys[0]: 1}), weakref.WeakValueDictionary({"v": values[0]})]
    sent.append(weakref.WeakSet(keys))
    [keys_, values_, by_key, by_value, items] = _round_trip(sent)
    assert by_key[keys_[0]] == 1 and by_value["v"] is values_[0] and set(items) == set(keys_)


def test_a_held_lock_arrives_unlocked_of_its_kind_and_a_condition_keeps_sharing_its_lock():
    lock, rlock = threading.Lock(), threading.RLock()
    condition, event = threading.Condition(rlock), threading.Event()
    event.set()
    with lock, rlock:
        lock_, rlock_, condition_, event_ = _round_trip([lock, rlock, condition, event])
    assert not lock_.locked() and type(lock_) is type(lock) and type(rlock_) is type(rlock)
    assert condition_._lock is rlock_ and event_.is_set()
    assert rlock_.acquire(blocking=False)  # unlocked here, whoever held it there
    rlock_.release()


def test_a_queue_keeps_its_items_and_one_lock_under_its_conditions():
    sent: queue.Queue[int] = queue.Queue()
    sent.put(1)
    copy = _round_trip(sent)
    assert copy.get_nowait() == 1
    assert copy.not_empty._lock is copy.mutex is copy.not_full._lock


def test_a_thread_is_refused_naming_it_though_its_locks_would_travel():
    with pytest.raises(pickle.PicklingError, match=r"cannot pickle a thread \(feeder\): .* start it inside the cell"):
        codepickle.dumps_keeping_filenames({"thread": threading.Thread(name="feeder")})
