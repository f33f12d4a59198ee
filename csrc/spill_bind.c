/* spill_bind.c: moepeak._C's spill_* functions, the binding of the disk tier
 * (spill.c; the contract, alignment and tail handling: spill.h).
 *
 *   spill_open(dir, capacity=0, threads=4, direct=-1, tmpfile=True) -> handle
 *       a capsule owning the anonymous spill file; direct -1: O_DIRECT where
 *       the filesystem accepts it, else buffered; 0: buffered; 1: O_DIRECT or
 *       OSError. tmpfile=False skips O_TMPFILE (create + unlink at once).
 *   spill_info(handle) -> {"direct", "dir", "threads", "written_end", "in_flight"}
 *   spill_submit_write(handle, addr, nbytes, offset) -> ticket   (buffer -> file)
 *   spill_submit_read(handle, addr, nbytes, offset) -> ticket    (file -> buffer)
 *       addr: the host buffer's address (an int: a pinned 4096-aligned
 *       allocation the caller keeps alive and untouched until the ticket is
 *       waited on); addr and offset multiples of 4096, nbytes >= 1.
 *   spill_poll(handle, ticket) -> bool   done (successfully or not)?
 *   spill_wait(handle, ticket)           blocks without the GIL; releases the
 *       ticket; an I/O error raises OSError(errno, message with the byte range
 *       and the failing offset, the directory).
 *   spill_close(handle)                  waits for the requests in flight
 *       (without the GIL), frees the file's space; idempotent. The capsule's
 *       destructor closes too.
 * Bad arguments raise ValueError/TypeError naming them before anything is queued. */
#include <stdio.h>
#include <string.h>

#include "mp_checks.h"
#include "spill.h"

#define SPILL_CAPSULE "moepeak.spill_file"
#define SPILL_MAX_BYTES ((long long)1 << 62) /* offsets and sizes below this: offset + round_up(nbytes) fits */

static void spill_capsule_free(PyObject *cap) {
  mp_spill_free((mp_spill *)PyCapsule_GetPointer(cap, SPILL_CAPSULE));
}

static mp_spill *spill_arg(const char *fn, PyObject *handle) {
  if (!PyCapsule_IsValid(handle, SPILL_CAPSULE)) {
    PyErr_Format(PyExc_TypeError, "moepeak._C.%s: handle must be a spill file from spill_open, got %s", fn,
                 Py_TYPE(handle)->tp_name);
    return NULL;
  }
  return (mp_spill *)PyCapsule_GetPointer(handle, SPILL_CAPSULE);
}

/* OSError(err, "moepeak: <mp_last_error()>", dir): errno, the message with the
 * byte range, and the spill directory as the filename. Returns NULL. */
static PyObject *raise_os_error(int err, const char *dir) {
  PyObject *msg = PyUnicode_FromFormat("moepeak: %s", mp_last_error());
  PyObject *path = msg ? PyUnicode_DecodeFSDefault(dir) : NULL;
  PyObject *exc = path ? PyObject_CallFunction(PyExc_OSError, "iOO", err, msg, path) : NULL;
  if (exc) PyErr_SetObject((PyObject *)Py_TYPE(exc), exc); /* the errno's subclass, e.g. FileNotFoundError */
  Py_XDECREF(exc);
  Py_XDECREF(path);
  Py_XDECREF(msg);
  return NULL;
}

static PyObject *py_spill_open(PyObject *self, PyObject *args, PyObject *kwargs) {
  (void)self;
  static char *kwlist[] = {"dir", "capacity", "threads", "direct", "tmpfile", NULL};
  PyObject *dir = NULL, *cap = NULL;
  long long capacity = 0;
  int threads = 4, direct = MP_SPILL_DIRECT_AUTO, tmpfile = 1, err = 0;
  mp_spill *f = NULL;
  mp_status st;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O&|Liip:spill_open", kwlist, PyUnicode_FSConverter, &dir,
                                   &capacity, &threads, &direct, &tmpfile))
    return NULL;
  const char *path = PyBytes_AS_STRING(dir);
  if (path[0] == '\0') {
    PyErr_SetString(PyExc_ValueError, "moepeak._C.spill_open: dir must name a directory, got ''");
    goto fail;
  }
  if (mp_check_min("spill_open", "capacity", capacity, 0) ||
      mp_check_range("spill_open", "threads", threads, 1, MP_SPILL_MAX_THREADS + 1) ||
      mp_check_range("spill_open", "direct", direct, -1, 2))
    goto fail;
  Py_BEGIN_ALLOW_THREADS st = mp_spill_open(path, (int64_t)capacity, threads, direct, tmpfile, &f, &err);
  Py_END_ALLOW_THREADS
  if (st == MP_ERR_SYS) {
    raise_os_error(err, path);
    goto fail;
  }
  if (st != MP_OK) {
    mp_raise_status(st);
    goto fail;
  }
  cap = PyCapsule_New(f, SPILL_CAPSULE, spill_capsule_free);
  if (!cap) mp_spill_free(f);
fail:
  Py_XDECREF(dir);
  return cap;
}

static PyObject *py_spill_info(PyObject *self, PyObject *handle) {
  (void)self;
  mp_spill *f = spill_arg("spill_info", handle);
  if (!f) return NULL;
  return Py_BuildValue("{s:O,s:N,s:i,s:L,s:i}", "direct", mp_spill_direct(f) ? Py_True : Py_False, "dir",
                       PyUnicode_DecodeFSDefault(mp_spill_dir(f)), "threads", mp_spill_threads(f), "written_end",
                       (long long)mp_spill_written_end(f), "in_flight", mp_spill_in_flight(f));
}

/* spill_submit_{write,read}(handle, addr, nbytes, offset) -> ticket */
static PyObject *spill_submit(PyObject *args, int is_write) {
  const char *fn = is_write ? "spill_submit_write" : "spill_submit_read";
  PyObject *handle;
  unsigned long long addr;
  long long nbytes, offset;
  if (!PyArg_ParseTuple(args, is_write ? "OKLL:spill_submit_write" : "OKLL:spill_submit_read", &handle, &addr,
                        &nbytes, &offset))
    return NULL;
  mp_spill *f = spill_arg(fn, handle);
  if (!f) return NULL;
  char hex[32]; /* PyErr_Format has no %llx */
  snprintf(hex, sizeof hex, "0x%llx", addr);
  if (addr == 0 || addr % MP_SPILL_ALIGN != 0) {
    PyErr_Format(PyExc_ValueError, "moepeak._C.%s: buffer address %s must be a non-null multiple of %d "
                 "(allocate the buffer %d-aligned, e.g. pinned host memory)", fn, hex, MP_SPILL_ALIGN,
                 MP_SPILL_ALIGN);
    return NULL;
  }
  if (mp_check_range(fn, "nbytes", nbytes, 1, SPILL_MAX_BYTES) ||
      mp_check_range(fn, "offset", offset, 0, SPILL_MAX_BYTES))
    return NULL;
  if (offset % MP_SPILL_ALIGN != 0) {
    PyErr_Format(PyExc_ValueError, "moepeak._C.%s: offset %lld must be a multiple of %d", fn, offset,
                 MP_SPILL_ALIGN);
    return NULL;
  }
  if (addr > UINT64_MAX - (unsigned long long)nbytes) {
    PyErr_Format(PyExc_ValueError, "moepeak._C.%s: the buffer [%s, + %lld bytes) wraps the address space", fn, hex,
                 nbytes);
    return NULL;
  }
  int64_t ticket = 0;
  mp_status st = mp_spill_submit(f, is_write, (void *)(uintptr_t)addr, nbytes, offset, &ticket);
  if (st != MP_OK) return mp_raise_status(st);
  return PyLong_FromLongLong(ticket);
}

static PyObject *py_spill_submit_write(PyObject *self, PyObject *args) {
  (void)self;
  return spill_submit(args, 1);
}

static PyObject *py_spill_submit_read(PyObject *self, PyObject *args) {
  (void)self;
  return spill_submit(args, 0);
}

static PyObject *py_spill_poll(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *handle;
  long long ticket;
  int done = 0;
  if (!PyArg_ParseTuple(args, "OL:spill_poll", &handle, &ticket)) return NULL;
  mp_spill *f = spill_arg("spill_poll", handle);
  if (!f) return NULL;
  mp_status st = mp_spill_poll(f, ticket, &done);
  if (st != MP_OK) return mp_raise_status(st);
  return PyBool_FromLong(done);
}

static PyObject *py_spill_wait(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *handle;
  long long ticket;
  mp_spill_error e;
  mp_status st;
  if (!PyArg_ParseTuple(args, "OL:spill_wait", &handle, &ticket)) return NULL;
  mp_spill *f = spill_arg("spill_wait", handle);
  if (!f) return NULL;
  Py_BEGIN_ALLOW_THREADS st = mp_spill_wait(f, ticket, &e);
  Py_END_ALLOW_THREADS
  if (st == MP_ERR_SYS) return raise_os_error(e.err, mp_spill_dir(f));
  return mp_return_none(st);
}

static PyObject *py_spill_close(PyObject *self, PyObject *handle) {
  (void)self;
  mp_spill *f = spill_arg("spill_close", handle);
  if (!f) return NULL;
  mp_status st;
  Py_BEGIN_ALLOW_THREADS st = mp_spill_close(f);
  Py_END_ALLOW_THREADS
  return mp_return_none(st);
}

PyMethodDef mp_spill_methods[] = {
    {"spill_open", (PyCFunction)(void (*)(void))py_spill_open, METH_VARARGS | METH_KEYWORDS,
     "spill_open(dir, capacity=0, threads=4, direct=-1, tmpfile=True) -> handle: an unlinked spill file in dir "
     "(O_DIRECT where accepted), capacity bytes reserved."},
    {"spill_info", py_spill_info, METH_O,
     "spill_info(handle) -> dict(direct, dir, threads, written_end, in_flight)"},
    {"spill_submit_write", py_spill_submit_write, METH_VARARGS,
     "spill_submit_write(handle, addr, nbytes, offset) -> ticket: write host bytes [addr, addr+nbytes) to the file "
     "at offset (addr, offset multiples of 4096)."},
    {"spill_submit_read", py_spill_submit_read, METH_VARARGS,
     "spill_submit_read(handle, addr, nbytes, offset) -> ticket: read file bytes [offset, offset+nbytes) into addr."},
    {"spill_poll", py_spill_poll, METH_VARARGS, "spill_poll(handle, ticket) -> bool: the request has completed."},
    {"spill_wait", py_spill_wait, METH_VARARGS,
     "spill_wait(handle, ticket): block until done (GIL released), release the ticket; OSError on an I/O error."},
    {"spill_close", py_spill_close, METH_O,
     "spill_close(handle): wait for requests in flight, close and free the file (idempotent)."},
    {NULL, NULL, 0, NULL},
};
