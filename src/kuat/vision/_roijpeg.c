/*
 * kuat.vision._roijpeg: decode only the region of a JPEG that a crop needs (ROI decode).
 *
 * libjpeg-turbo (>= 1.5) can skip rows (jpeg_skip_scanlines: entropy-decoded only, no IDCT,
 * upsampling or colour conversion), restrict the columns it reconstructs to a window
 * (jpeg_crop_scanline, widened to iMCU boundaries), stop after the last needed row
 * (jpeg_abort_decompress) and scale the DCT by k/8. This is what DALI's ROI decoding does.
 * The GIL is released while decoding.
 *
 * decode_crop(data, scale_num, y0, y1, x0, x1, out, channels=3) -> None
 *   data       bytes-like JPEG (YCbCr or grayscale; CMYK/YCCK are refused)
 *   scale_num  1, 2, 4 or 8: decode at scale_num / 8
 *   y0, y1     rows [y0, y1) of the scaled image
 *   x0, x1     columns [x0, x1) of the scaled image
 *   out        writable C-contiguous buffer of at least (y1 - y0) * (x1 - x0) * channels bytes
 *   channels   3 (RGB) or 4 (RGBX, X = 255)
 * Writes the crop as (y1 - y0) rows of (x1 - x0) pixels, contiguous; the pixels equal the
 * same region of a full decode at that scale. Corrupt data and libjpeg warnings (such as
 * a premature end of data) raise ValueError, like simplejpeg's strict mode.
 *
 * Build: cc -O2 -shared -fPIC $(python3-config --includes) _roijpeg.c -ljpeg
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <jpeglib.h>

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
} kuat_error_mgr;

static void kuat_error_exit(j_common_ptr cinfo) {
    kuat_error_mgr *err = (kuat_error_mgr *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void kuat_emit_message(j_common_ptr cinfo, int msg_level) {
    if (msg_level < 0) { /* a warning: corrupt data; strict like simplejpeg */
        kuat_error_mgr *err = (kuat_error_mgr *)cinfo->err;
        (*cinfo->err->format_message)(cinfo, err->message);
        longjmp(err->jump, 1);
    }
}

static PyObject *decode_crop(PyObject *self, PyObject *args) {
    Py_buffer data, out;
    int scale_num, channels = 3;
    unsigned int y0, y1, x0, x1;
    if (!PyArg_ParseTuple(args, "y*iIIIIw*|i", &data, &scale_num, &y0, &y1, &x0, &x1, &out,
                          &channels))
        return NULL;
    if (channels != 3 && channels != 4) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&out);
        return PyErr_Format(PyExc_ValueError, "channels must be 3 or 4, got %d", channels);
    }

    struct jpeg_decompress_struct cinfo;
    kuat_error_mgr jerr;
    volatile int failed = 0, bad_args = 0; /* volatile: read after a longjmp */
    char arg_message[160] = "";
    JDIMENSION xoff = 0, width = 0;
    unsigned char *volatile row_free = NULL; /* volatile: survives longjmp */

    Py_BEGIN_ALLOW_THREADS
    cinfo.err = jpeg_std_error(&jerr.pub);
    jerr.pub.error_exit = kuat_error_exit;
    jerr.pub.emit_message = kuat_emit_message;
    jerr.message[0] = '\0';
    if (setjmp(jerr.jump)) {
        failed = 1;
    } else {
        jpeg_create_decompress(&cinfo);
        jpeg_mem_src(&cinfo, (const unsigned char *)data.buf, (unsigned long)data.len);
        jpeg_read_header(&cinfo, TRUE);
        if (cinfo.jpeg_color_space != JCS_YCbCr && cinfo.jpeg_color_space != JCS_GRAYSCALE &&
            cinfo.jpeg_color_space != JCS_RGB) {
            bad_args = 1;
            snprintf(arg_message, sizeof arg_message, "unsupported JPEG colour space %d",
                     (int)cinfo.jpeg_color_space);
        } else {
            /* RGBX: 4 bytes per pixel, the layout torch's uint8 resize kernel works in */
            cinfo.out_color_space = channels == 4 ? JCS_EXT_RGBX : JCS_RGB;
            cinfo.scale_num = (unsigned int)scale_num;
            cinfo.scale_denom = 8;
            cinfo.dct_method = JDCT_ISLOW;
            cinfo.do_fancy_upsampling = TRUE;
            jpeg_start_decompress(&cinfo);
            if (y0 >= y1 || y1 > cinfo.output_height || x0 >= x1 || x1 > cinfo.output_width) {
                bad_args = 1;
                snprintf(arg_message, sizeof arg_message,
                         "crop rows [%u, %u) cols [%u, %u) outside the %ux%u scaled image",
                         y0, y1, x0, x1, cinfo.output_width, cinfo.output_height);
            } else {
                /* 2 extra columns on the left and 8 on the right: fancy (triangle) chroma
                 * upsampling at the window's edges needs the neighbouring samples to give
                 * the same pixels as a full decode (jpeg_crop_scanline then widens the
                 * window to iMCU boundaries) */
                xoff = x0 >= 2 ? x0 - 2 : 0;
                width = (x1 + 8 < cinfo.output_width ? x1 + 8 : cinfo.output_width) - xoff;
                if (width < cinfo.output_width)
                    jpeg_crop_scanline(&cinfo, &xoff, &width);
                else
                    xoff = 0, width = cinfo.output_width;
                size_t stride = (size_t)width * channels;          /* one decoded window row */
                size_t out_stride = (size_t)(x1 - x0) * channels;  /* one row of the crop */
                unsigned char *row_buf = (unsigned char *)malloc(stride);
                row_free = row_buf;
                if (row_buf == NULL) {
                    bad_args = 1;
                    snprintf(arg_message, sizeof arg_message, "out of memory");
                } else if ((size_t)out.len < out_stride * (y1 - y0)) {
                    bad_args = 1;
                    snprintf(arg_message, sizeof arg_message,
                             "out buffer of %zd bytes is smaller than %zu", out.len,
                             out_stride * (y1 - y0));
                } else {
                    if (y0 > 0)
                        jpeg_skip_scanlines(&cinfo, y0);
                    unsigned char *dst = (unsigned char *)out.buf;
                    const unsigned char *src = row_buf + (size_t)(x0 - xoff) * channels;
                    JSAMPROW row = row_buf;
                    /* the row stays in L1; only the crop's columns reach `out`, contiguous */
                    while (cinfo.output_scanline < y1) {
                        size_t r = cinfo.output_scanline - y0;
                        jpeg_read_scanlines(&cinfo, &row, 1);
                        memcpy(dst + out_stride * r, src, out_stride);
                    }
                }
            }
        }
        jpeg_abort_decompress(&cinfo); /* rows below y1 are never decoded */
    }
    jpeg_destroy_decompress(&cinfo);
    free(row_free);
    Py_END_ALLOW_THREADS

    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    if (failed) {
        PyErr_Format(PyExc_ValueError, "JPEG decode failed: %s", jerr.message);
        return NULL;
    }
    if (bad_args) {
        PyErr_SetString(PyExc_ValueError, arg_message);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode_crop", decode_crop, METH_VARARGS,
     "decode_crop(data, scale_num, y0, y1, x0, x1, out, channels=3) -> None: the crop, contiguous"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_roijpeg",
                                    "ROI JPEG decoding with libjpeg-turbo", -1, methods};

PyMODINIT_FUNC PyInit__roijpeg(void) { return PyModule_Create(&module); }
