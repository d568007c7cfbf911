/* Jagged rows padded back to a dense block in one call: a memcpy per row and a fill per pad.
 *
 * numpy's concatenate does the same copies but needs a Python slice object per row and per pad,
 * which costs more than the copies themselves for a group of 16 rows of a few thousand tokens.
 * Pure: no I/O, no allocation of its own; the caller owns every buffer and passes addresses.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static void fill_items(char *dst, Py_ssize_t count, const char *item, Py_ssize_t itemsize) {
    Py_ssize_t i, done;
    if (count <= 0) return;
    for (i = 1; i < itemsize && item[i] == item[0]; i++) {
    }
    if (i == itemsize) { /* all bytes alike, as for 0 or -1 of any width: one memset */
        memset(dst, (unsigned char)item[0], (size_t)(count * itemsize));
        return;
    }
    memcpy(dst, item, (size_t)itemsize);
    /* Double the filled prefix: log2(count) memcpy calls instead of one per element. */
    for (done = 1; done < count;) {
        Py_ssize_t n = done < count - done ? done : count - done;
        memcpy(dst + done * itemsize, dst, (size_t)(n * itemsize));
        done += n;
    }
}

/* pad_rows(dst, dst_items, src, src_items, offsets, n_rows, lengths, scale, row_width, fill)
 *
 * Addresses come from torch's data_ptr() of contiguous CPU tensors that the Python wrapper
 * (schemas.jagged.pad_rows) holds for the duration of the call, with their sizes in items:
 * dst receives n_rows x row_width items; src holds the jagged values; offsets holds int64 row
 * starts (n_rows + 1 of them when lengths is 0, else n_rows); lengths, when not 0, holds n_rows
 * int64 row lengths, else each row runs to the next offset; offsets and lengths count in units
 * of `scale` items; fill is one item's bytes, which also gives the item size. Every row is
 * checked against src and row_width, and copied into a private table, before anything is
 * written; the copy reads only that table, so a caller editing offsets meanwhile cannot steer it.
 */
static PyObject *pad_rows(PyObject *self, PyObject *args) {
    unsigned long long dst_addr, src_addr, off_addr, len_addr;
    Py_ssize_t dst_items, src_items, n, scale, row_width, itemsize, i;
    const char *fill;
    const int64_t *off, *len;
    Py_ssize_t *rows; /* (start, count) in items, checked once and then used for the copy */
    char *out;
    const char *in;

    if (!PyArg_ParseTuple(args, "KnKnKnKnny#", &dst_addr, &dst_items, &src_addr, &src_items,
                          &off_addr, &n, &len_addr, &scale, &row_width, &fill, &itemsize))
        return NULL;
    if (itemsize <= 0 || scale <= 0 || row_width < 0 || n < 0 || src_items < 0) {
        PyErr_SetString(PyExc_ValueError, "bad item size, scale, row width or row count");
        return NULL;
    }
    if (dst_items != n * row_width) {
        PyErr_Format(PyExc_ValueError, "output holds %zd items, not %zd rows x %zd", dst_items, n,
                     row_width);
        return NULL;
    }
    rows = PyMem_Malloc(sizeof(Py_ssize_t) * 2 * (size_t)(n ? n : 1));
    if (rows == NULL) return PyErr_NoMemory();
    off = (const int64_t *)(uintptr_t)off_addr;
    len = (const int64_t *)(uintptr_t)len_addr;
    for (i = 0; i < n; i++) {
        int64_t start = off[i], count;
        if (len) {
            count = len[i];
        } else { /* next - start cannot overflow once both are known non-negative and ordered */
            int64_t next = off[i + 1];
            count = start >= 0 && next >= start ? next - start : -1;
        }
        if (start < 0 || count < 0 || start > src_items / scale || count > row_width / scale ||
            count > src_items / scale - start) {
            PyErr_Format(PyExc_ValueError,
                         "row %zd (offset %lld, length %lld, x%zd items) lies outside its %zd "
                         "values or is wider than %zd", i, (long long)start, (long long)count,
                         scale, src_items, row_width);
            PyMem_Free(rows);
            return NULL;
        }
        rows[2 * i] = (Py_ssize_t)start * scale;
        rows[2 * i + 1] = (Py_ssize_t)count * scale;
    }
    out = (char *)(uintptr_t)dst_addr;
    in = (const char *)(uintptr_t)src_addr;
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < n && row_width > 0; i++) {
        char *row = out + i * row_width * itemsize;
        if (rows[2 * i + 1] > 0)
            memcpy(row, in + rows[2 * i] * itemsize, (size_t)(rows[2 * i + 1] * itemsize));
        fill_items(row + rows[2 * i + 1] * itemsize, row_width - rows[2 * i + 1], fill, itemsize);
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(rows);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"pad_rows", pad_rows, METH_VARARGS,
     "pad_rows(dst, dst_items, src, src_items, offsets, n_rows, lengths, scale, row_width, fill)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rowcopy(void) { return PyModule_Create(&module); }
