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
 * resize_planar(src, h, w, channels, out, out_h, out_w, flip,
 *               x_start, x_weights, x_taps, x_precision,
 *               y_start, y_weights, y_taps, y_precision) -> None
 *   src        C-contiguous (h, w, channels) uint8, channels 3 or 4 (the 4th is ignored)
 *   out        writable C-contiguous (3, out_h, out_w) uint8: planar, the batch slot layout
 *   flip       nonzero: mirror left-right while writing
 *   x_start    (out_w,) int32: first source column of each output column
 *   x_weights  (out_w, x_taps) int16 fixed-point weights with x_precision fraction bits
 *   y_*        the same for rows
 * Separable resize, horizontal pass first with a uint8 intermediate, int32 accumulators
 * rounded and clamped after each pass: the arithmetic of torch's uint8 antialiased kernel
 * (itself Pillow-SIMD's), so with torch's weights (kuat.vision.resize.taps) the pixels
 * are torch's. Fused here: the interleaved -> planar layout change and the flip, which
 * otherwise cost a strided copy of the output. Kernels: AVX2, SSSE3, SSE2 or plain C, the
 * best the CPU runs (see simd()); integer sums, so every kernel gives the same bytes. The GIL
 * is released.
 *
 * decode_resize_batch(jobs, out, n_slots, out_h, out_w, next=None) -> [(job_index, message), ...]
 *   jobs   sequence of (data, scale_num, y0, y1, x0, x1, slot, flip, x_start, x_weights,
 *          x_taps, x_precision, y_start, y_weights, y_taps, y_precision): decode_crop's
 *          arguments (RGBX) and resize_planar's, the output going to out[slot]
 *   out    writable C-contiguous (n_slots, 3, out_h, out_w) uint8: the batch buffer
 *   next   None (every job), or a writable 4-byte aligned int32 counter, 0 at first, shared
 *          by calls on several threads with the same jobs: each call takes the next job not
 *          yet taken (an atomic add) until none is left, and reports only the jobs it took;
 *          the batch is then shared job by job, however unequal the jobs
 * Every job of a batch in one call with the GIL released once (a thread worker then holds
 * the GIL only to plan the batch: per-image calls made 16 decoding threads contend for it
 * twice per image). The decoded rows go through the horizontal pass 16 at a time as libjpeg
 * gives them (no crop buffer, no copy; the same pixels as decode_crop then resize_planar).
 * Returns the jobs that could not be decoded with the reason (their slots
 * are left unwritten: the caller decodes them one by one, which reports or falls back);
 * malformed jobs (slot, box, taps) raise ValueError before anything is decoded.
 *
 * simd(level=-1) -> level
 *   The resize kernels in use: 0 plain C, 1 SSE2, 2 SSSE3, 3 AVX2 (chosen at run time: the
 *   best the CPU has). level >= 0 lowers it (ValueError above the CPU's best). Every level
 *   gives the same pixels (integer sums); tests compare them. Not thread-safe.
 *
 * load(path) -> (copyright, file)
 *   dlopen a libjpeg-turbo (the 62 ABI) and route every jpeg_* call below through it; returns
 *   the library's copyright line and the file it was loaded from. Raises OSError if it cannot be loaded, lacks a symbol, or
 *   refuses our JPEG_LIB_VERSION / struct size (an ABI mismatch); the previous library, if
 *   any, stays in use then. decode_crop raises RuntimeError until a load succeeded. Not safe
 *   to call while another thread decodes (kuat.vision._libjpeg calls it once, at import).
 *
 * Build: cc -O2 -shared -fPIC $(python3-config --includes) -I _libjpeg_turbo/include
 *        _roijpeg.c -ldl (python -m kuat.vision._build_roijpeg does this; setup.py the same).
 *        No -ljpeg and no system headers: the module compiles against libjpeg-turbo 3.1.2's
 *        vendored public headers and finds a libjpeg-turbo at run time (Pillow's bundled copy
 *        or the system's; kuat/vision/_libjpeg.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <dlfcn.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>
#include <time.h>
#include <jpeglib.h> /* the vendored _libjpeg_turbo/include comes first on the include path */

/* libjpeg is not linked. load() dlopens one (RTLD_LOCAL: its symbols never interpose on
 * another copy in the process, such as torchvision's or simplejpeg's) and fills this table;
 * the macros below send the decoder's jpeg_* calls through it, so the decode code reads as
 * plain libjpeg. The types come from the vendored prototypes (a mismatch does not compile). */
typedef struct {
    __typeof__(jpeg_std_error) *std_error;
    __typeof__(jpeg_CreateDecompress) *CreateDecompress;
    __typeof__(jpeg_destroy_decompress) *destroy_decompress;
    __typeof__(jpeg_abort_decompress) *abort_decompress;
    __typeof__(jpeg_mem_src) *mem_src;
    __typeof__(jpeg_read_header) *read_header;
    __typeof__(jpeg_start_decompress) *start_decompress;
    __typeof__(jpeg_crop_scanline) *crop_scanline;
    __typeof__(jpeg_skip_scanlines) *skip_scanlines;
    __typeof__(jpeg_read_scanlines) *read_scanlines;
} kuat_libjpeg;

static kuat_libjpeg kj; /* all NULL until load() succeeds */

/* The resize kernels used: 0 plain C, 1 SSE2, 2 SSSE3, 3 AVX2; -1 until first asked, then the
 * best this CPU runs. simd(level) lowers it (the tests compare every level's pixels). */
enum { SIMD_C = 0, SIMD_SSE2 = 1, SIMD_SSSE3 = 2, SIMD_AVX2 = 3 };
static int simd_level = -1;

static int simd_best(void) {
#if defined(__SSE2__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2"))
        return SIMD_AVX2;
    if (__builtin_cpu_supports("ssse3"))
        return SIMD_SSSE3;
    return SIMD_SSE2;
#else
    return SIMD_C;
#endif
}

static int simd(void) {
    if (simd_level < 0)
        simd_level = simd_best();
    return simd_level;
}

#define jpeg_std_error (kj.std_error)
#define jpeg_CreateDecompress (kj.CreateDecompress)
#define jpeg_destroy_decompress (kj.destroy_decompress)
#define jpeg_abort_decompress (kj.abort_decompress)
#define jpeg_mem_src (kj.mem_src)
#define jpeg_read_header (kj.read_header)
#define jpeg_start_decompress (kj.start_decompress)
#define jpeg_crop_scanline (kj.crop_scanline)
#define jpeg_skip_scanlines (kj.skip_scanlines)
#define jpeg_read_scanlines (kj.read_scanlines)

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

/* The decode of one crop, without the GIL: rows [y0, y1) and columns [x0, x1) of the JPEG at
 * scale_num / 8 into `out` (out_len bytes, rows of (x1 - x0) * channels bytes). Returns
 * ROI_OK, ROI_CORRUPT (libjpeg failed or warned: corrupt or truncated data) or ROI_BAD_ARGS
 * (unsupported colour space, box outside the image, buffer too small, out of memory); the
 * reason is written to msg (ROI_MSG bytes). Calls no Python API. With `sink`, the rows go to
 * its horizontal resize pass as libjpeg hands them over (tmp row = crop row), still in cache,
 * and `out` is not used: no crop buffer, no copy. */
enum { ROI_OK = 0, ROI_CORRUPT = 1, ROI_BAD_ARGS = 2, ROI_MSG = 160 };

/* Bytes readable past a decoded row buffer: what the AVX2 resize kernel may read past a window
 * (3 pixels), so that every row of a crop takes it. */
#define KUAT_ROW_PAD 64

typedef struct hpass hpass;
static void hpass_rows(const hpass *hp, const unsigned char *src, size_t stride, size_t room,
                       int n, int y);

static int roi_decode(const unsigned char *buf, size_t len, int scale_num, unsigned int y0,
                      unsigned int y1, unsigned int x0, unsigned int x1, unsigned char *out,
                      size_t out_len, int channels, const hpass *sink, char *msg) {
    struct jpeg_decompress_struct cinfo;
    kuat_error_mgr jerr;
    volatile int failed = 0, bad_args = 0; /* volatile: read after a longjmp */
    JDIMENSION xoff = 0, width = 0;
    unsigned char *volatile row_free = NULL; /* volatile: survives longjmp */
    msg[0] = '\0';

    cinfo.err = jpeg_std_error(&jerr.pub);
    jerr.pub.error_exit = kuat_error_exit;
    jerr.pub.emit_message = kuat_emit_message;
    jerr.message[0] = '\0';
    if (setjmp(jerr.jump)) {
        failed = 1;
    } else {
        jpeg_create_decompress(&cinfo);
        jpeg_mem_src(&cinfo, buf, (unsigned long)len);
        jpeg_read_header(&cinfo, TRUE);
        if (cinfo.jpeg_color_space != JCS_YCbCr && cinfo.jpeg_color_space != JCS_GRAYSCALE &&
            cinfo.jpeg_color_space != JCS_RGB) {
            bad_args = 1;
            snprintf(msg, ROI_MSG, "unsupported JPEG colour space %d",
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
                snprintf(msg, ROI_MSG,
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
                /* up to 16 rows per call (an iMCU row at 8/8 is 8 or 16): a call per row
                 * ran libjpeg's per-call pipeline (main, coefficient and upsampling
                 * controllers) once per row, 10-15% of a smooth image's decode */
                enum { group = 16 };
                unsigned char *row_buf = (unsigned char *)malloc(stride * group + KUAT_ROW_PAD);
                row_free = row_buf;
                if (row_buf == NULL) {
                    bad_args = 1;
                    snprintf(msg, ROI_MSG, "out of memory");
                } else if (sink == NULL && out_len < out_stride * (y1 - y0)) {
                    bad_args = 1;
                    snprintf(msg, ROI_MSG, "out buffer of %zu bytes is smaller than %zu",
                             out_len, out_stride * (y1 - y0));
                } else {
                    if (y0 > 0)
                        jpeg_skip_scanlines(&cinfo, y0);
                    const unsigned char *src = row_buf + (size_t)(x0 - xoff) * channels;
                    JSAMPROW rows[group];
                    for (int g = 0; g < group; g++)
                        rows[g] = row_buf + stride * g;
                    /* the rows stay in L1/L2; only the crop's columns reach `out`, contiguous.
                     * libjpeg hands over a row group per call (2 rows with 2x2 chroma
                     * subsampling): the buffer is filled over several calls, so the resize's
                     * 4-row kernels see full groups */
                    while (!failed && cinfo.output_scanline < y1) {
                        size_t r = cinfo.output_scanline - y0;
                        JDIMENSION want = y1 - cinfo.output_scanline, have = 0;
                        if (want > group)
                            want = group;
                        while (have < want) {
                            JDIMENSION got =
                                jpeg_read_scanlines(&cinfo, rows + have, want - have);
                            if (got == 0) { /* suspension: not with a memory source; no spin */
                                failed = 1;
                                snprintf(jerr.message, sizeof jerr.message, "no rows at row %u",
                                         (unsigned)cinfo.output_scanline);
                                break;
                            }
                            have += got;
                        }
                        if (sink != NULL)
                            hpass_rows(sink, src, stride,
                                       stride * group + KUAT_ROW_PAD - (size_t)(src - row_buf),
                                       (int)have, (int)r);
                        else
                            for (JDIMENSION g = 0; g < have; g++)
                                memcpy(out + out_stride * (r + g), src + stride * g, out_stride);
                    }
                }
            }
        }
        jpeg_abort_decompress(&cinfo); /* rows below y1 are never decoded */
    }
    jpeg_destroy_decompress(&cinfo);
    free(row_free);
    if (failed) {
        snprintf(msg, ROI_MSG, "JPEG decode failed: %s", jerr.message);
        return ROI_CORRUPT;
    }
    return bad_args ? ROI_BAD_ARGS : ROI_OK;
}

static PyObject *decode_crop(PyObject *self, PyObject *args) {
    if (kj.read_scanlines == NULL)
        return PyErr_Format(PyExc_RuntimeError, "no libjpeg loaded: call load(path) first");
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
    char msg[ROI_MSG];
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = roi_decode((const unsigned char *)data.buf, (size_t)data.len, scale_num, y0, y1, x0,
                    x1, (unsigned char *)out.buf, (size_t)out.len, channels, NULL, msg);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    if (rc != ROI_OK) {
        PyErr_SetString(PyExc_ValueError, msg);
        return NULL;
    }
    Py_RETURN_NONE;
}

static inline unsigned char clip8(int32_t v, int precision) {
    v >>= precision;
    return (unsigned char)(v < 0 ? 0 : v > 255 ? 255 : v);
}

#if defined(__SSE2__)
#include <emmintrin.h>

/* Output column x of 4 RGBX rows (row pointers rows[0..3]): two taps per pmaddwd (channel
 * pairs (c, c') of neighbouring pixels times the weight pair (k0, k1)), 4 rows sharing each
 * weight pair, as torch's and Pillow-SIMD's kernels do. Stores the 4 pixels' R, G, B into the
 * three planes at offsets d + r * out_w. */
/* The end every 4-row kernel shares: tap t (the odd last one, when taps is odd), then the 4
 * accumulators rounded, clamped and stored as R, G, B into the three planes (SSE2 only, so the
 * SSSE3 kernel inlines it too). */
static inline __attribute__((always_inline)) void rgbx_finish4(
    const unsigned char *p0, const unsigned char *p1, const unsigned char *p2,
    const unsigned char *p3, const int16_t *k, int t, int taps, int precision, __m128i a0,
    __m128i a1, __m128i a2, __m128i a3, unsigned char *t0, unsigned char *t1, unsigned char *t2,
    size_t d, int out_w) {
    const __m128i zero = _mm_setzero_si128();
    if (t < taps) { /* odd tap: one pixel, weight pair (k, 0) */
        __m128i kv = _mm_set1_epi32((uint16_t)k[t]);
        size_t o = 4 * (size_t)t;
        int32_t v0, v1, v2, v3;
        memcpy(&v0, p0 + o, 4);
        memcpy(&v1, p1 + o, 4);
        memcpy(&v2, p2 + o, 4);
        memcpy(&v3, p3 + o, 4);
#define KUAT_ONE(v) _mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(v), zero), zero)
        a0 = _mm_add_epi32(a0, _mm_madd_epi16(KUAT_ONE(v0), kv));
        a1 = _mm_add_epi32(a1, _mm_madd_epi16(KUAT_ONE(v1), kv));
        a2 = _mm_add_epi32(a2, _mm_madd_epi16(KUAT_ONE(v2), kv));
        a3 = _mm_add_epi32(a3, _mm_madd_epi16(KUAT_ONE(v3), kv));
#undef KUAT_ONE
    }
    __m128i p01 = _mm_packs_epi32(_mm_srai_epi32(a0, precision), _mm_srai_epi32(a1, precision));
    __m128i p23 = _mm_packs_epi32(_mm_srai_epi32(a2, precision), _mm_srai_epi32(a3, precision));
    __m128i px = _mm_packus_epi16(p01, p23); /* 4 RGBX pixels, rows 0..3 */
    /* registers, not a stack round trip (a 16-byte store read back bytewise stalls) */
    uint64_t lo = (uint64_t)_mm_cvtsi128_si64(px);
    uint64_t hi = (uint64_t)_mm_cvtsi128_si64(_mm_srli_si128(px, 8));
#define KUAT_PUT(r, q)                                        \
    do {                                                      \
        size_t at = d + (size_t)(r) * out_w;                  \
        t0[at] = (unsigned char)(q);                          \
        t1[at] = (unsigned char)((q) >> 8);                   \
        t2[at] = (unsigned char)((q) >> 16);                  \
    } while (0)
    KUAT_PUT(0, (uint32_t)lo);
    KUAT_PUT(1, (uint32_t)(lo >> 32));
    KUAT_PUT(2, (uint32_t)hi);
    KUAT_PUT(3, (uint32_t)(hi >> 32));
#undef KUAT_PUT
}

#define KUAT_PAIR(px) _mm_unpacklo_epi16((px), _mm_srli_si128((px), 8)) /* c c' pairs */
static inline void rgbx_column4(const unsigned char *const rows[4], size_t off,
                                const int16_t *k, int taps, int precision, unsigned char *t0,
                                unsigned char *t1, unsigned char *t2, size_t d, int out_w) {
    const __m128i zero = _mm_setzero_si128();
    const unsigned char *p0 = rows[0] + off, *p1 = rows[1] + off, *p2 = rows[2] + off,
                        *p3 = rows[3] + off;
    __m128i a0 = _mm_set1_epi32((int32_t)1 << (precision - 1)), a1 = a0, a2 = a0, a3 = a0;
    int t = 0;
    for (; t + 2 <= taps; t += 2) {
        uint32_t kk = (uint16_t)k[t] | ((uint32_t)(uint16_t)k[t + 1] << 16);
        __m128i kv = _mm_set1_epi32((int32_t)kk);
        size_t o = 4 * (size_t)t;
        __m128i x0 = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(p0 + o)), zero);
        __m128i x1 = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(p1 + o)), zero);
        __m128i x2 = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(p2 + o)), zero);
        __m128i x3 = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(p3 + o)), zero);
        a0 = _mm_add_epi32(a0, _mm_madd_epi16(KUAT_PAIR(x0), kv));
        a1 = _mm_add_epi32(a1, _mm_madd_epi16(KUAT_PAIR(x1), kv));
        a2 = _mm_add_epi32(a2, _mm_madd_epi16(KUAT_PAIR(x2), kv));
        a3 = _mm_add_epi32(a3, _mm_madd_epi16(KUAT_PAIR(x3), kv));
    }
    rgbx_finish4(p0, p1, p2, p3, k, t, taps, precision, a0, a1, a2, a3, t0, t1, t2, d, out_w);
}
#undef KUAT_PAIR
#include <tmmintrin.h>
__attribute__((target("ssse3"))) static inline void rgbx_column4_ssse3(const unsigned char *const rows[4], size_t off,
                                const int16_t *k, int taps, int precision, unsigned char *t0,
                                unsigned char *t1, unsigned char *t2, size_t d, int out_w) {
    const unsigned char *p0 = rows[0] + off, *p1 = rows[1] + off, *p2 = rows[2] + off,
                        *p3 = rows[3] + off;
    __m128i a0 = _mm_set1_epi32((int32_t)1 << (precision - 1)), a1 = a0, a2 = a0, a3 = a0;
    int t = 0;
    for (; t + 2 <= taps; t += 2) {
        uint32_t kk = (uint16_t)k[t] | ((uint32_t)(uint16_t)k[t + 1] << 16);
        __m128i kv = _mm_set1_epi32((int32_t)kk);
        size_t o = 4 * (size_t)t;
        /* one pshufb: bytes c0 c0' c1 c1' ... widened to int16 pairs */
        const __m128i m = _mm_setr_epi8(0, -1, 4, -1, 1, -1, 5, -1, 2, -1, 6, -1, 3, -1, 7, -1);
        __m128i x0 = _mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *)(p0 + o)), m);
        __m128i x1 = _mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *)(p1 + o)), m);
        __m128i x2 = _mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *)(p2 + o)), m);
        __m128i x3 = _mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *)(p3 + o)), m);
        a0 = _mm_add_epi32(a0, _mm_madd_epi16(x0, kv));
        a1 = _mm_add_epi32(a1, _mm_madd_epi16(x1, kv));
        a2 = _mm_add_epi32(a2, _mm_madd_epi16(x2, kv));
        a3 = _mm_add_epi32(a3, _mm_madd_epi16(x3, kv));
    }
    rgbx_finish4(p0, p1, p2, p3, k, t, taps, precision, a0, a1, a2, a3, t0, t1, t2, d, out_w);
}


__attribute__((target("ssse3"))) static void rows4_ssse3(
    const unsigned char *const rows[4], int out_w, int flip, const int32_t *start,
    const int16_t *weights, int taps, int precision, unsigned char *t0, unsigned char *t1,
    unsigned char *t2) {
    for (int x = 0; x < out_w; x++)
        rgbx_column4_ssse3(rows, (size_t)start[x] * 4, weights + (size_t)x * taps, taps,
                           precision, t0, t1, t2, (size_t)(flip ? out_w - 1 - x : x), out_w);
}

#include <immintrin.h>

/* AVX2, 4 RGBX rows: rows 0 and 1 share a register (one per 128-bit lane), as do rows 2 and 3,
 * and the taps go 4 at a time: one 16-byte load per row (4 pixels), two pshufb to (c, c') int16
 * pairs of neighbouring pixels, two pmaddwd with the weight pairs (k0, k1) and (k2, k3).
 * `wpad` is the weights padded with zeros to `taps4` (a multiple of 4) per column, so the
 * loads may read up to 3 pixels past a window (their weight is 0): past the row's end that is
 * the next row, and the caller keeps the last row of the image off this kernel unless the
 * buffer has room. Columns are done 4 at a time and written with a 4x4 transpose: per row and
 * plane one 4-byte store (12 per 16 pixels, where the per-column kernel stores 48 bytes one by
 * one). Integer sums, so the order of the taps changes nothing: the pixels are the SSSE3
 * kernel's, which are torch's. Columns past the last multiple of 4 go to the SSSE3 kernel
 * (with the unpadded weights). */
__attribute__((target("avx2"))) static void rows4_avx2(
    const unsigned char *const rows[4], int out_w, int flip, const int32_t *start,
    const int16_t *weights, int taps, const int16_t *wpad, int taps4, int precision,
    unsigned char *t0, unsigned char *t1, unsigned char *t2) {
    const __m256i m_lo = _mm256_setr_epi8(0, -1, 4, -1, 1, -1, 5, -1, 2, -1, 6, -1, 3, -1, 7, -1,
                                          0, -1, 4, -1, 1, -1, 5, -1, 2, -1, 6, -1, 3, -1, 7, -1);
    const __m256i m_hi =
        _mm256_setr_epi8(8, -1, 12, -1, 9, -1, 13, -1, 10, -1, 14, -1, 11, -1, 15, -1, 8, -1, 12,
                         -1, 9, -1, 13, -1, 10, -1, 14, -1, 11, -1, 15, -1);
    /* a row's 4 RGBX pixels (columns c0..c3) -> R c0..c3, G c0..c3, B c0..c3 (X dropped);
     * flipped: the columns in reverse */
    const __m128i planar = flip ? _mm_setr_epi8(12, 8, 4, 0, 13, 9, 5, 1, 14, 10, 6, 2, 15, 11, 7, 3)
                                : _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m256i half = _mm256_set1_epi32((int32_t)1 << (precision - 1));
    const unsigned char *r0 = rows[0], *r1 = rows[1], *r2 = rows[2], *r3 = rows[3];
    int x = 0;
    for (; x + 4 <= out_w; x += 4) {
        __m128i col[4]; /* column x + c: RGBX of rows 0..3 */
        for (int c = 0; c < 4; c++) {
            size_t off = (size_t)start[x + c] * 4;
            const int16_t *k = wpad + (size_t)(x + c) * taps4;
            __m256i a01 = half, a23 = half;
            for (int t = 0; t < taps4; t += 4, off += 16) {
                int32_t k01, k23;
                memcpy(&k01, k + t, 4);
                memcpy(&k23, k + t + 2, 4);
                const __m256i kv01 = _mm256_set1_epi32(k01), kv23 = _mm256_set1_epi32(k23);
                __m256i s01 = _mm256_inserti128_si256(
                    _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(r0 + off))),
                    _mm_loadu_si128((const __m128i *)(r1 + off)), 1);
                __m256i s23 = _mm256_inserti128_si256(
                    _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(r2 + off))),
                    _mm_loadu_si128((const __m128i *)(r3 + off)), 1);
                a01 = _mm256_add_epi32(a01, _mm256_madd_epi16(_mm256_shuffle_epi8(s01, m_lo), kv01));
                a01 = _mm256_add_epi32(a01, _mm256_madd_epi16(_mm256_shuffle_epi8(s01, m_hi), kv23));
                a23 = _mm256_add_epi32(a23, _mm256_madd_epi16(_mm256_shuffle_epi8(s23, m_lo), kv01));
                a23 = _mm256_add_epi32(a23, _mm256_madd_epi16(_mm256_shuffle_epi8(s23, m_hi), kv23));
            }
            /* lane 0: rows 0, 2; lane 1: rows 1, 3 (int16, then bytes) */
            __m256i p = _mm256_packs_epi32(_mm256_srai_epi32(a01, precision),
                                           _mm256_srai_epi32(a23, precision));
            p = _mm256_packus_epi16(p, p);
            col[c] = _mm_unpacklo_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
        }
        /* 4x4 transpose of pixels: columns of 4 rows -> rows of 4 columns */
        __m128i u0 = _mm_unpacklo_epi32(col[0], col[1]), u1 = _mm_unpackhi_epi32(col[0], col[1]);
        __m128i u2 = _mm_unpacklo_epi32(col[2], col[3]), u3 = _mm_unpackhi_epi32(col[2], col[3]);
        __m128i rv[4] = {_mm_unpacklo_epi64(u0, u2), _mm_unpackhi_epi64(u0, u2),
                         _mm_unpacklo_epi64(u1, u3), _mm_unpackhi_epi64(u1, u3)};
        const size_t d = (size_t)(flip ? out_w - 4 - x : x);
        for (int r = 0; r < 4; r++) {
            __m128i v = _mm_shuffle_epi8(rv[r], planar);
            int32_t R = _mm_cvtsi128_si32(v), G = _mm_extract_epi32(v, 1), B = _mm_extract_epi32(v, 2);
            size_t at = d + (size_t)r * out_w;
            memcpy(t0 + at, &R, 4);
            memcpy(t1 + at, &G, 4);
            memcpy(t2 + at, &B, 4);
        }
    }
    for (; x < out_w; x++)
        rgbx_column4_ssse3(rows, (size_t)start[x] * 4, weights + (size_t)x * taps, taps,
                           precision, t0, t1, t2, (size_t)(flip ? out_w - 1 - x : x), out_w);
}

/* vertical_pass's 16 columns at a time (AVX2): out[x .. x + 16) of one plane's output row. */
__attribute__((target("avx2"))) static int vertical_row_avx2(const unsigned char *r0, int out_w,
                                                             unsigned char *o, const int16_t *k,
                                                             int taps, int precision) {
    const __m256i zero = _mm256_setzero_si256(), half = _mm256_set1_epi32((int32_t)1 << (precision - 1));
    int x = 0;
    for (; x + 16 <= out_w; x += 16) {
        __m256i lo = half, hi = half;
        int t = 0;
        for (; t + 2 <= taps; t += 2) {
            const unsigned char *ra = r0 + (size_t)t * out_w + x;
            __m256i a = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)ra));
            __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(ra + out_w)));
            int32_t kk;
            memcpy(&kk, k + t, 4);
            const __m256i kv = _mm256_set1_epi32(kk);
            lo = _mm256_add_epi32(lo, _mm256_madd_epi16(_mm256_unpacklo_epi16(a, b), kv));
            hi = _mm256_add_epi32(hi, _mm256_madd_epi16(_mm256_unpackhi_epi16(a, b), kv));
        }
        if (t < taps) {
            const unsigned char *ra = r0 + (size_t)t * out_w + x;
            __m256i a = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)ra));
            const __m256i kv = _mm256_set1_epi32((uint16_t)k[t]);
            lo = _mm256_add_epi32(lo, _mm256_madd_epi16(_mm256_unpacklo_epi16(a, zero), kv));
            hi = _mm256_add_epi32(hi, _mm256_madd_epi16(_mm256_unpackhi_epi16(a, zero), kv));
        }
        /* per lane: columns 0-3 | 4-7 (lane 0) and 8-11 | 12-15 (lane 1), back in order */
        __m256i v = _mm256_packs_epi32(_mm256_srai_epi32(lo, precision), _mm256_srai_epi32(hi, precision));
        v = _mm256_permute4x64_epi64(_mm256_packus_epi16(v, v), 0x08);
        _mm_storeu_si128((__m128i *)(o + x), _mm256_castsi256_si128(v));
    }
    return x;
}
#endif

/* The horizontal pass: (rows, w, C) interleaved -> planar rows of out_w, each output column
 * from `taps` source columns; flip mirrors the output columns. One per resize; hpass_init fills
 * it, hpass_rows runs it over any run of rows, hpass_free frees it. */
struct hpass {
    int channels, out_w, flip, taps, precision, level;
    const int32_t *start;
    const int16_t *weights;
    int16_t *wpad;   /* AVX2: the weights padded with zeros to taps4 per column, or NULL */
    int taps4;
    size_t reach;    /* one past the last byte a padded window reads, from a row's start */
    unsigned char *tmp; /* plane 0; planes `plane` bytes apart, rows out_w bytes apart */
    size_t plane;
};

static void hpass_init(hpass *hp, int channels, int out_w, int flip, const int32_t *start,
                       const int16_t *weights, int taps, int precision, unsigned char *tmp,
                       size_t plane) {
    hp->channels = channels, hp->out_w = out_w, hp->flip = flip, hp->taps = taps;
    hp->precision = precision, hp->start = start, hp->weights = weights, hp->tmp = tmp;
    hp->plane = plane, hp->wpad = NULL, hp->taps4 = (taps + 3) & ~3, hp->reach = 0;
    hp->level = simd();
#if defined(__SSE2__)
    if (hp->level >= SIMD_AVX2 && channels == 4 &&
        (hp->wpad = (int16_t *)calloc((size_t)out_w * hp->taps4, sizeof(int16_t))) != NULL) {
        for (int x = 0; x < out_w; x++) {
            memcpy(hp->wpad + (size_t)x * hp->taps4, weights + (size_t)x * taps,
                   (size_t)taps * sizeof(int16_t));
            size_t end = ((size_t)start[x] + hp->taps4) * 4;
            if (end > hp->reach)
                hp->reach = end;
        }
    }
#endif
}

static void hpass_free(hpass *hp) {
    free(hp->wpad);
    hp->wpad = NULL;
}

/* n rows, row r at src + r * stride (`room` bytes readable from src), into tmp rows y .. y + n.
 * SIMD kernels take 4 rows at a time; a last group of fewer repeats the last row and writes the
 * extra rows to tmp rows y + n .. y + n + 2, which the next run overwrites (runs go top to
 * bottom) or which lie in the 3 spare rows a plane has past the image. */
static void hpass_rows(const hpass *hp, const unsigned char *src, size_t stride, size_t room,
                       int n, int y) {
    const int out_w = hp->out_w, flip = hp->flip, taps = hp->taps, precision = hp->precision;
    const int32_t *start = hp->start;
    const int16_t *weights = hp->weights;
    const size_t plane = hp->plane;
    int r = 0;
#if defined(__SSE2__)
    if (hp->channels == 4 && hp->level >= SIMD_SSE2) {
        for (; r < n; r += 4) {
            const unsigned char *rows[4];
            int last = r + 3 < n ? r + 3 : n - 1;
            for (int k = 0; k < 4; k++)
                rows[k] = src + (size_t)(r + k <= last ? r + k : last) * stride;
            unsigned char *t0 = hp->tmp + (size_t)(y + r) * out_w, *t1 = t0 + plane,
                          *t2 = t1 + plane;
            if (hp->wpad != NULL && (size_t)last * stride + hp->reach <= room)
                rows4_avx2(rows, out_w, flip, start, weights, taps, hp->wpad, hp->taps4,
                           precision, t0, t1, t2);
            else if (hp->level >= SIMD_SSSE3)
                rows4_ssse3(rows, out_w, flip, start, weights, taps, precision, t0, t1, t2);
            else
                for (int x = 0; x < out_w; x++)
                    rgbx_column4(rows, (size_t)start[x] * 4, weights + (size_t)x * taps, taps,
                                 precision, t0, t1, t2, (size_t)(flip ? out_w - 1 - x : x), out_w);
        }
        return;
    }
#endif
    const int32_t half = (int32_t)1 << (precision - 1);
    const int channels = hp->channels;
    for (; r < n; r++) {
        const unsigned char *row = src + (size_t)r * stride;
        unsigned char *t0 = hp->tmp + (size_t)(y + r) * out_w, *t1 = t0 + plane, *t2 = t1 + plane;
        for (int x = 0; x < out_w; x++) {
            const unsigned char *p = row + (size_t)start[x] * channels;
            const int16_t *k = weights + (size_t)x * taps;
            int32_t cr = half, cg = half, cb = half;
            for (int t = 0; t < taps; t++, p += channels) {
                cr += p[0] * k[t];
                cg += p[1] * k[t];
                cb += p[2] * k[t];
            }
            int d = flip ? out_w - 1 - x : x;
            t0[d] = clip8(cr, precision);
            t1[d] = clip8(cg, precision);
            t2[d] = clip8(cb, precision);
        }
    }
}

/* The rows of tmp a plane needs for an h-row source: h, and 3 spare for hpass_rows. */
#define KUAT_TMP_ROWS(h) ((size_t)(h) + 3)

/* (3, h, out_w) planes `plane_bytes` apart -> (3, out_h, out_w), each output row a weighted
 * sum of y_taps rows. */
static void vertical_pass(const unsigned char *tmp, size_t plane_bytes, unsigned char *out,
                          int out_h, int out_w, const int32_t *start, const int16_t *weights,
                          int taps, int precision) {
    const int32_t half = (int32_t)1 << (precision - 1);
#if defined(__SSE2__)
    const int level = simd();
#endif
    for (int c = 0; c < 3; c++) {
        const unsigned char *plane = tmp + (size_t)c * plane_bytes;
        for (int y = 0; y < out_h; y++) {
            const int16_t *k = weights + (size_t)y * taps;
            const unsigned char *r0 = plane + (size_t)start[y] * out_w;
            unsigned char *o = out + ((size_t)c * out_h + y) * out_w;
            int x = 0;
#if defined(__SSE2__)
            if (level >= SIMD_AVX2)
                x = vertical_row_avx2(r0, out_w, o, k, taps, precision);
            /* 8 columns at a time, two rows per pmaddwd */
            const __m128i zero = _mm_setzero_si128();
            for (; level >= SIMD_SSE2 && x + 8 <= out_w; x += 8) {
                __m128i lo = _mm_set1_epi32(half), hi = lo;
                int t = 0;
                for (; t + 2 <= taps; t += 2) {
                    const unsigned char *ra = r0 + (size_t)t * out_w + x;
                    __m128i a = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)ra), zero);
                    __m128i b =
                        _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(ra + out_w)), zero);
                    uint32_t kk = (uint16_t)k[t] | ((uint32_t)(uint16_t)k[t + 1] << 16);
                    __m128i kv = _mm_set1_epi32((int32_t)kk);
                    lo = _mm_add_epi32(lo, _mm_madd_epi16(_mm_unpacklo_epi16(a, b), kv));
                    hi = _mm_add_epi32(hi, _mm_madd_epi16(_mm_unpackhi_epi16(a, b), kv));
                }
                if (t < taps) {
                    const unsigned char *ra = r0 + (size_t)t * out_w + x;
                    __m128i a = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)ra), zero);
                    __m128i kv = _mm_set1_epi32((uint16_t)k[t]);
                    lo = _mm_add_epi32(lo, _mm_madd_epi16(_mm_unpacklo_epi16(a, zero), kv));
                    hi = _mm_add_epi32(hi, _mm_madd_epi16(_mm_unpackhi_epi16(a, zero), kv));
                }
                lo = _mm_srai_epi32(lo, precision);
                hi = _mm_srai_epi32(hi, precision);
                __m128i v = _mm_packs_epi32(lo, hi);
                _mm_storel_epi64((__m128i *)(o + x), _mm_packus_epi16(v, v));
            }
#endif
            for (; x < out_w; x++) {
                int32_t a = half;
                for (int t = 0; t < taps; t++)
                    a += r0[(size_t)t * out_w + x] * k[t];
                o[x] = clip8(a, precision);
            }
        }
    }
}

static int check_taps(const Py_buffer *start, const Py_buffer *weights, int n, int taps,
                      int precision, int in_size, const char *axis) {
    if (taps < 1 || taps > in_size || precision < 1 || precision > 22 ||
        start->len < (Py_ssize_t)(n * sizeof(int32_t)) ||
        weights->len < (Py_ssize_t)((size_t)n * taps * sizeof(int16_t))) {
        PyErr_Format(PyExc_ValueError, "bad %s taps: %d outputs, %d taps, precision %d", axis,
                     n, taps, precision);
        return -1;
    }
    const int32_t *s = (const int32_t *)start->buf;
    for (int i = 0; i < n; i++)
        if (s[i] < 0 || s[i] + taps > in_size) {
            PyErr_Format(PyExc_ValueError, "%s tap window [%d, %d) outside [0, %d)", axis,
                         (int)s[i], (int)s[i] + taps, in_size);
            return -1;
        }
    return 0;
}

static PyObject *resize_planar(PyObject *self, PyObject *args) {
    Py_buffer src, out, xs, xw, ys, yw;
    int h, w, channels, out_h, out_w, flip, xt, xp, yt, yp;
    if (!PyArg_ParseTuple(args, "y*iiiw*iiiy*y*iiy*y*ii", &src, &h, &w, &channels, &out, &out_h,
                          &out_w, &flip, &xs, &xw, &xt, &xp, &ys, &yw, &yt, &yp))
        return NULL;
    PyObject *result = NULL;
    if (h <= 0 || w <= 0 || out_h <= 0 || out_w <= 0 || (channels != 3 && channels != 4)) {
        PyErr_Format(PyExc_ValueError, "bad resize_planar sizes: %dx%dx%d -> 3x%dx%d", h, w,
                     channels, out_h, out_w);
    } else if (src.len < (Py_ssize_t)((size_t)h * w * channels) ||
               out.len < (Py_ssize_t)((size_t)3 * out_h * out_w)) {
        PyErr_Format(PyExc_ValueError, "resize_planar buffers too small: src %zd, out %zd bytes",
                     src.len, out.len);
    } else if (check_taps(&xs, &xw, out_w, xt, xp, w, "column") == 0 &&
               check_taps(&ys, &yw, out_h, yt, yp, h, "row") == 0) {
        const size_t plane = KUAT_TMP_ROWS(h) * out_w;
        unsigned char *tmp = (unsigned char *)malloc(3 * plane);
        if (tmp == NULL) {
            PyErr_NoMemory();
        } else {
            Py_BEGIN_ALLOW_THREADS
            hpass hp;
            hpass_init(&hp, channels, out_w, flip, (const int32_t *)xs.buf,
                       (const int16_t *)xw.buf, xt, xp, tmp, plane);
            hpass_rows(&hp, (const unsigned char *)src.buf, (size_t)w * channels,
                       (size_t)src.len, h, 0);
            hpass_free(&hp);
            vertical_pass(tmp, plane, (unsigned char *)out.buf, out_h, out_w,
                          (const int32_t *)ys.buf, (const int16_t *)yw.buf, yt, yp);
            Py_END_ALLOW_THREADS
            result = Py_None;
            Py_INCREF(result);
        }
        free(tmp);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    PyBuffer_Release(&xs);
    PyBuffer_Release(&xw);
    PyBuffer_Release(&ys);
    PyBuffer_Release(&yw);
    return result;
}

/* numpy's pairwise summation of n doubles (numpy/_core/src/umath/loops_utils.h.src), so
 * that the weights' normalisation rounds exactly as kuat.vision.resize.taps's NumPy
 * reference (w.sum(axis=1)) does. */
static double pairwise_sum(const double *a, Py_ssize_t n) {
    if (n < 8) {
        double res = 0.;
        for (Py_ssize_t i = 0; i < n; i++)
            res += a[i];
        return res;
    } else if (n <= 128) {
        double r[8], res;
        Py_ssize_t i;
        for (int k = 0; k < 8; k++)
            r[k] = a[k];
        for (i = 8; i < n - (n % 8); i += 8)
            for (int k = 0; k < 8; k++)
                r[k] += a[i + k];
        res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++)
            res += a[i];
        return res;
    } else {
        Py_ssize_t n2 = n / 2;
        n2 -= n2 % 8;
        return pairwise_sum(a, n2) + pairwise_sum(a + n2, n - n2);
    }
}

/* The weights of taps_py into malloc'd *start_out (out,) and *weights_out (out, taps), which
 * the caller frees (one block: free(*start_out) frees both). Calls no Python API (runs with
 * the GIL released in plan_decode_rrc). Returns 0, or -1 when out of memory. */
static int taps_c(int in_size, int out_size, int32_t **start_out, int16_t **weights_out,
                  int *taps_out, int *precision_out) {
    double scale = (double)in_size / (double)out_size;
    double support = scale >= 1.0 ? scale : 1.0;
    double invscale = scale >= 1.0 ? 1.0 / scale : 1.0;
    int64_t *xmin = (int64_t *)malloc(sizeof(int64_t) * out_size * 2);
    if (xmin == NULL)
        return -1;
    int64_t *xsize = xmin + out_size;
    int64_t taps = 0;
    for (int i = 0; i < out_size; i++) {
        double center = scale * ((double)i + 0.5);
        int64_t lo = (int64_t)(center - support + 0.5);
        int64_t hi = (int64_t)(center + support + 0.5);
        xmin[i] = lo > 0 ? lo : 0;
        xsize[i] = (hi < in_size ? hi : in_size) - xmin[i];
        if (xsize[i] > taps)
            taps = xsize[i];
    }
    double *w = (double *)malloc(sizeof(double) * (size_t)out_size * (size_t)taps);
    /* start (out,) int32 then weights (out, taps) int16: one block, 4-byte aligned */
    char *block = (char *)malloc((size_t)out_size * 4 + (size_t)out_size * taps * 2);
    if (w == NULL || block == NULL) {
        free(xmin);
        free(w);
        free(block);
        return -1;
    }
    double w_max = 0.0;
    for (int i = 0; i < out_size; i++) {
        double center = scale * ((double)i + 0.5);
        double *row = w + (size_t)i * taps;
        for (int64_t j = 0; j < taps; j++) {
            double v = 1.0 - fabs((((double)(j + xmin[i])) - center + 0.5) * invscale);
            row[j] = (j < xsize[i] && v > 0.0) ? v : 0.0;
        }
        double total = pairwise_sum(row, taps);
        if (total == 0.0)
            total = 1.0;
        for (int64_t j = 0; j < taps; j++) {
            row[j] = row[j] / total;
            if (row[j] > w_max)
                w_max = row[j];
        }
    }
    int precision = 0;
    while (precision < 22 && (int64_t)(0.5 + w_max * (double)(1 << (precision + 1))) < (1 << 15))
        precision++;
    int32_t *start = (int32_t *)block;
    int16_t *weights = (int16_t *)(block + (size_t)out_size * 4);
    memset(weights, 0, (size_t)out_size * taps * 2);
    for (int i = 0; i < out_size; i++) {
        int64_t st = xmin[i] < in_size - taps ? xmin[i] : in_size - taps;
        int64_t shift = xmin[i] - st;
        start[i] = (int32_t)st;
        for (int64_t j = 0; j + shift < taps; j++)
            weights[(size_t)i * taps + j + shift] =
                (int16_t)floor(0.5 + w[(size_t)i * taps + j] * (double)(1 << precision));
    }
    free(xmin);
    free(w);
    *start_out = start, *weights_out = weights, *taps_out = (int)taps;
    *precision_out = precision;
    return 0;
}

/* taps(in_size, out_size) -> (start bytes (out,) int32, weights bytes (out, taps) int16, taps,
 * precision): kuat.vision.resize.taps computed in C (the same float64 operations in the
 * same order; tests compare the two over thousands of sizes). */
static PyObject *taps_py(PyObject *self, PyObject *args) {
    int in_size, out_size, taps, precision;
    int32_t *start;
    int16_t *weights;
    if (!PyArg_ParseTuple(args, "ii", &in_size, &out_size))
        return NULL;
    if (in_size <= 0 || out_size <= 0)
        return PyErr_Format(PyExc_ValueError, "taps: sizes must be positive, got %d -> %d",
                            in_size, out_size);
    if (taps_c(in_size, out_size, &start, &weights, &taps, &precision) != 0)
        return PyErr_NoMemory();
    PyObject *res = Py_BuildValue("y#y#ii", (const char *)start, (Py_ssize_t)out_size * 4,
                                  (const char *)weights, (Py_ssize_t)out_size * taps * 2, taps,
                                  precision);
    free(start);
    return res;
}

static PyObject *load(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path))
        return NULL;
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL)
        return PyErr_Format(PyExc_OSError, "cannot load %s: %s", path, dlerror());
    kuat_libjpeg t;
    const char *missing = NULL;
#define KUAT_SYM(field, name)                                                  \
    if (missing == NULL && (*(void **)&t.field = dlsym(handle, name)) == NULL) \
        missing = name;
    KUAT_SYM(std_error, "jpeg_std_error")
    KUAT_SYM(CreateDecompress, "jpeg_CreateDecompress")
    KUAT_SYM(destroy_decompress, "jpeg_destroy_decompress")
    KUAT_SYM(abort_decompress, "jpeg_abort_decompress")
    KUAT_SYM(mem_src, "jpeg_mem_src")
    KUAT_SYM(read_header, "jpeg_read_header")
    KUAT_SYM(start_decompress, "jpeg_start_decompress")
    KUAT_SYM(crop_scanline, "jpeg_crop_scanline")  /* libjpeg-turbo >= 1.5 only */
    KUAT_SYM(skip_scanlines, "jpeg_skip_scanlines")
    KUAT_SYM(read_scanlines, "jpeg_read_scanlines")
#undef KUAT_SYM
    if (missing != NULL) {
        dlclose(handle);
        return PyErr_Format(PyExc_OSError,
                            "%s has no %s: not a libjpeg-turbo >= 1.5 with the libjpeg 6.2 API",
                            path, missing);
    }
    /* The ABI check libjpeg itself makes: jpeg_CreateDecompress refuses a caller whose
     * JPEG_LIB_VERSION or sizeof(struct jpeg_decompress_struct) differs from its own. */
    struct jpeg_decompress_struct cinfo;
    kuat_error_mgr jerr;
    char copyright[JMSG_LENGTH_MAX] = "";
    cinfo.err = t.std_error(&jerr.pub);
    jerr.pub.error_exit = kuat_error_exit;
    jerr.pub.emit_message = kuat_emit_message;
    jerr.message[0] = '\0';
    if (setjmp(jerr.jump)) {
        dlclose(handle); /* nothing was allocated: the check precedes the memory manager */
        return PyErr_Format(PyExc_OSError, "%s refused kuat's libjpeg ABI (JPEG_LIB_VERSION %d, "
                            "struct of %zu bytes): %s", path, JPEG_LIB_VERSION,
                            sizeof(struct jpeg_decompress_struct), jerr.message);
    }
    t.CreateDecompress(&cinfo, JPEG_LIB_VERSION, sizeof(struct jpeg_decompress_struct));
    t.destroy_decompress(&cinfo);
    /* the library's own message table (message codes differ between versions: search it) */
    for (int i = 0; jerr.pub.jpeg_message_table != NULL && i <= jerr.pub.last_jpeg_message; i++) {
        const char *m = jerr.pub.jpeg_message_table[i];
        if (m != NULL && strncmp(m, "Copyright", 9) == 0) {
            snprintf(copyright, sizeof copyright, "%s", m);
            break;
        }
    }
    /* the file the dynamic linker chose (a soname may resolve to a copy already loaded) */
    Dl_info where;
    const char *file = dladdr(*(void **)&t.read_scanlines, &where) && where.dli_fname != NULL
                           ? where.dli_fname
                           : path;
    kj = t; /* the handle stays open for the life of the process */
    return Py_BuildValue("(Ns)",
                         PyUnicode_DecodeLatin1(copyright, (Py_ssize_t)strcspn(copyright, "\n"),
                                                NULL),
                         file);
}

/* Ask the kernel to read the pages of buf[0:len) now (madvise MADV_WILLNEED), so that a batch's
 * encoded images, scattered over a memory-mapped shard not in the page cache, are read all at
 * once rather than one page fault at a time as the decodes reach them (what the format's
 * gather did per row in Python: kuat.format.shard._Var.will_need). A hint: errors (memory
 * that is not a file mapping, a platform without it) are ignored. Calls no Python API. */
static void advise_willneed(const void *buf, size_t len) {
#if defined(MADV_WILLNEED)
    static long page = 0;
    if (page <= 0)
        page = sysconf(_SC_PAGESIZE);
    if (len == 0 || page <= 0)
        return;
    uintptr_t lo = (uintptr_t)buf & ~((uintptr_t)page - 1);
    (void)madvise((void *)lo, (uintptr_t)buf + len - lo, MADV_WILLNEED);
#else
    (void)buf;
    (void)len;
#endif
}

/* One job of decode_resize_batch: a crop decoded and resized into one batch slot. */
typedef struct {
    Py_buffer data, xs, xw, ys, yw;
    int scale_num, slot, flip, xt, xp, yt, yp;
    unsigned int y0, y1, x0, x1;
    int held; /* buffers to release */
} roi_job;

static void release_job(roi_job *j) {
    if (!j->held)
        return;
    PyBuffer_Release(&j->data);
    PyBuffer_Release(&j->xs);
    PyBuffer_Release(&j->xw);
    PyBuffer_Release(&j->ys);
    PyBuffer_Release(&j->yw);
    j->held = 0;
}

static PyObject *decode_resize_batch(PyObject *self, PyObject *args) {
    if (kj.read_scanlines == NULL)
        return PyErr_Format(PyExc_RuntimeError, "no libjpeg loaded: call load(path) first");
    PyObject *jobs_obj, *next_obj = Py_None;
    Py_buffer out, next = {0};
    int n_slots, out_h, out_w;
    if (!PyArg_ParseTuple(args, "Ow*iii|O", &jobs_obj, &out, &n_slots, &out_h, &out_w,
                          &next_obj))
        return NULL;
    int32_t *shared = NULL; /* the next job to take, shared by concurrent calls; or NULL */
    if (next_obj != Py_None) {
        if (PyObject_GetBuffer(next_obj, &next, PyBUF_WRITABLE) != 0) {
            PyBuffer_Release(&out);
            return NULL;
        }
        if (next.len < (Py_ssize_t)sizeof(int32_t) || ((uintptr_t)next.buf & 3) != 0) {
            PyBuffer_Release(&next);
            PyBuffer_Release(&out);
            return PyErr_Format(PyExc_ValueError, "next must be a writable, 4-byte aligned "
                                "buffer of at least 4 bytes (an int32 counter)");
        }
        shared = (int32_t *)next.buf;
    }
    PyObject *result = NULL, *seq = NULL;
    roi_job *jobs = NULL;
    int *codes = NULL;
    char *msgs = NULL;
    Py_ssize_t n = 0, parsed = 0;
    const size_t slot_bytes = (size_t)3 * (size_t)(out_h > 0 ? out_h : 0) * (out_w > 0 ? out_w : 0);
    if (out_h <= 0 || out_w <= 0 || n_slots < 0 || (size_t)out.len < slot_bytes * n_slots) {
        PyErr_Format(PyExc_ValueError, "out of %zd bytes cannot hold %d slots of 3x%dx%d",
                     out.len, n_slots, out_h, out_w);
        goto done;
    }
    seq = PySequence_Fast(jobs_obj, "jobs must be a sequence of tuples");
    if (seq == NULL)
        goto done;
    n = PySequence_Fast_GET_SIZE(seq);
    jobs = (roi_job *)calloc(n > 0 ? n : 1, sizeof(roi_job));
    codes = (int *)calloc(n > 0 ? n : 1, sizeof(int));
    msgs = (char *)calloc(n > 0 ? n : 1, ROI_MSG);
    if (jobs == NULL || codes == NULL || msgs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    size_t max_tmp = 0;
    for (; parsed < n; parsed++) {
        roi_job *j = &jobs[parsed];
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, parsed), "y*iIIIIiiy*y*iiy*y*ii",
                              &j->data, &j->scale_num, &j->y0, &j->y1, &j->x0, &j->x1,
                              &j->slot, &j->flip, &j->xs, &j->xw, &j->xt, &j->xp, &j->ys,
                              &j->yw, &j->yt, &j->yp))
            goto done;
        j->held = 1;
        if (j->slot < 0 || j->slot >= n_slots || j->y0 >= j->y1 || j->x0 >= j->x1 ||
            (j->scale_num != 1 && j->scale_num != 2 && j->scale_num != 4 && j->scale_num != 8)) {
            PyErr_Format(PyExc_ValueError, "job %zd: slot %d of %d, rows [%u, %u), cols [%u, %u), "
                         "scale %d/8", parsed, j->slot, n_slots, j->y0, j->y1, j->x0, j->x1,
                         j->scale_num);
            goto done;
        }
        int h = (int)(j->y1 - j->y0), w = (int)(j->x1 - j->x0);
        if (check_taps(&j->xs, &j->xw, out_w, j->xt, j->xp, w, "column") != 0 ||
            check_taps(&j->ys, &j->yw, out_h, j->yt, j->yp, h, "row") != 0)
            goto done;
        size_t tmp = 3 * KUAT_TMP_ROWS(h) * out_w;
        if (tmp > max_tmp)
            max_tmp = tmp;
    }
    unsigned char *tmp_buf = NULL;
    int oom = 0;
    Py_BEGIN_ALLOW_THREADS
    if (shared == NULL || __atomic_load_n(shared, __ATOMIC_RELAXED) == 0)
        for (Py_ssize_t k = 0; k < n; k++)
            advise_willneed(jobs[k].data.buf, (size_t)jobs[k].data.len);
    tmp_buf = (unsigned char *)malloc(max_tmp ? max_tmp : 1);
    if (tmp_buf == NULL) {
        oom = 1;
    } else {
        for (Py_ssize_t k = 0; k < n; k++) {
            /* shared: take the next job no other call has taken (calls on several threads
             * then share the batch job by job, whichever finishes first takes more) */
            Py_ssize_t i =
                shared != NULL ? (Py_ssize_t)__atomic_fetch_add(shared, 1, __ATOMIC_RELAXED) : k;
            if (i >= n)
                break;
            roi_job *j = &jobs[i];
            const size_t plane = KUAT_TMP_ROWS(j->y1 - j->y0) * out_w;
            /* the decoded rows go through the horizontal pass as they come (no crop buffer) */
            hpass hp;
            hpass_init(&hp, 4, out_w, j->flip, (const int32_t *)j->xs.buf,
                       (const int16_t *)j->xw.buf, j->xt, j->xp, tmp_buf, plane);
            codes[i] = roi_decode((const unsigned char *)j->data.buf, (size_t)j->data.len,
                                  j->scale_num, j->y0, j->y1, j->x0, j->x1, NULL, 0, 4, &hp,
                                  msgs + (size_t)i * ROI_MSG);
            hpass_free(&hp);
            if (codes[i] != ROI_OK)
                continue;
            vertical_pass(tmp_buf, plane, (unsigned char *)out.buf + slot_bytes * j->slot, out_h,
                          out_w, (const int32_t *)j->ys.buf, (const int16_t *)j->yw.buf, j->yt,
                          j->yp);
        }
    }
    free(tmp_buf);
    Py_END_ALLOW_THREADS
    if (oom) {
        PyErr_NoMemory();
        goto done;
    }
    result = PyList_New(0);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        if (codes[i] == ROI_OK)
            continue;
        PyObject *item = Py_BuildValue("(ns)", i, msgs + (size_t)i * ROI_MSG);
        if (item == NULL || PyList_Append(result, item) != 0)
            Py_CLEAR(result);
        Py_XDECREF(item);
    }
done:
    for (Py_ssize_t i = 0; jobs != NULL && i < n; i++)
        release_job(&jobs[i]);
    free(jobs);
    free(codes);
    free(msgs);
    Py_XDECREF(seq);
    PyBuffer_Release(&out);
    if (shared != NULL)
        PyBuffer_Release(&next);
    return result;
}

/* ---------------------------------------------------------------------------------------
 * The batch's planning in C: sample generators and RandomResizedCrop boxes.
 *
 * Per image, the Python planning around the decode (hashing the sample's seeds, making its
 * numpy Generator, drawing torchvision's box, parsing the header and EXIF, mapping the box
 * to the decoded grid) cost about 50 us, a tenth of a smooth 224 crop. The functions below
 * do the same arithmetic in C for a whole batch; kuat.vision.transforms uses them only for
 * Compose([RandomResizedCrop, RandomHorizontalFlip...]) and checks them against the Python
 * planner (tests/test_vision_plan.py: same seeds, same boxes, same draws).
 *
 * sample_words(seed, epoch, indices, seeds_out, words_out) -> None
 *   indices    (B,) int64, each >= 0 (checked by the caller)
 *   seeds_out  writable (B,) uint64: kuat.rng.sample_seed(seed, epoch, index)
 *   words_out  writable (B, 4) uint64: SeedSequence(that seed).generate_state(4, uint64),
 *              PCG64's seeding words (numpy/random/_pcg64.pyx)
 *   NumPy's SeedSequence hashing (numpy/random/bit_generator.pyx: mix_entropy, hashmix, mix,
 *   generate_state; Melissa O'Neill's seed_seq), as kuat/_seedseq.py does it in NumPy.
 *
 * plan_rrc(datas, widths, heights, words, out_h, out_w, scale_lo, scale_hi, log_ratio_lo,
 *          log_ratio_hi, ratio_lo, ratio_hi, flip_ps, max_pixels[, draws]) -> [job or None, ...]
 *   datas      B bytes-like images; widths, heights: (B,) int64, the oriented sizes (index)
 *   words      (B, 4) uint64: each sample's PCG64 seeding words (sample_words)
 *   flip_ps    sequence of p, one per RandomHorizontalFlip after the crop (may be empty)
 *   max_pixels stored width x height above which a sample is not planned here (-1: none)
 *   draws      optional writable (B,) int64: the doubles drawn for each planned sample (0
 *              for None), so that its generator, made later, continues after them
 *   For each sample: (scale_num, y0, y1, x0, x1, flip) as kuat's Python planner gives them
 *   (Compose.plan, then _roi_region: torchvision's get_params with the sample's PCG64
 *   doubles, DCT scale, EXIF mirror, the box snapped to the decoded grid), or None where the
 *   Python path must plan it (not a JPEG whose header this walk reads, 4 components, EXIF
 *   orientation 3-8, above max_pixels, a size <= 0, a box side inf or nan: Python raises).
 *   The float operations are Python's, in its order (built with -ffp-contract=off: no fused
 *   multiply-add), rounding half to even as Python's round().
 * ------------------------------------------------------------------------------------- */
#define SS_POOL 4
#define SS_INIT_A 0x43b0d7e5u
#define SS_MULT_A 0x931e8875u
#define SS_INIT_B 0x8b51f9ddu
#define SS_MULT_B 0x58f38dedu
#define SS_MIX_L 0xca01f9ddu
#define SS_MIX_R 0x4973f715u

static uint32_t ss_hashmix(uint32_t value, uint32_t *hash_const) {
    value ^= *hash_const;
    *hash_const *= SS_MULT_A;
    value *= *hash_const;
    return value ^ (value >> 16);
}

static uint32_t ss_mix(uint32_t x, uint32_t y) {
    uint32_t r = SS_MIX_L * x - SS_MIX_R * y;
    return r ^ (r >> 16);
}

/* SeedSequence(entropy[:n]).generate_state(n_words, uint32) */
static void seedseq_state(const uint32_t *entropy, int n, uint32_t *out, int n_words) {
    uint32_t pool[SS_POOL], hc = SS_INIT_A;
    for (int i = 0; i < SS_POOL; i++)
        pool[i] = ss_hashmix(i < n ? entropy[i] : 0, &hc);
    for (int src = 0; src < SS_POOL; src++)
        for (int dst = 0; dst < SS_POOL; dst++)
            if (src != dst)
                pool[dst] = ss_mix(pool[dst], ss_hashmix(pool[src], &hc));
    for (int src = SS_POOL; src < n; src++)
        for (int dst = 0; dst < SS_POOL; dst++)
            pool[dst] = ss_mix(pool[dst], ss_hashmix(entropy[src], &hc));
    uint32_t c = SS_INIT_B;
    for (int k = 0; k < n_words; k++) {
        uint32_t v = pool[k % SS_POOL] ^ c;
        c *= SS_MULT_B;
        v *= c;
        out[k] = v ^ (v >> 16);
    }
}

/* a 64-bit value as SeedSequence's entropy words: 1 word below 2**32 (0 included), else 2 */
static int ss_words(uint64_t v, uint32_t *w) {
    w[0] = (uint32_t)v;
    if (v >> 32) {
        w[1] = (uint32_t)(v >> 32);
        return 2;
    }
    return 1;
}

static void sample_words_one(uint64_t seed, uint64_t epoch, uint64_t index, uint64_t *seed_out,
                             uint64_t *words_out) {
    uint32_t ent[6], st[8];
    int n = ss_words(seed, ent);
    n += ss_words(epoch, ent + n);
    n += ss_words(index, ent + n);
    seedseq_state(ent, n, st, 2);
    uint64_t s = (uint64_t)st[0] | ((uint64_t)st[1] << 32);
    *seed_out = s;
    n = ss_words(s, ent);
    seedseq_state(ent, n, st, 8);
    for (int k = 0; k < 4; k++)
        words_out[k] = (uint64_t)st[2 * k] | ((uint64_t)st[2 * k + 1] << 32);
}

/* derive_seed(words) -> int: kuat.rng.derive_seed's 64-bit value for a tuple of at most 16
 * integers (anything with __index__: Python's, NumPy's, bools), each taken modulo 2**64:
 * SeedSequence(words).generate_state(2, uint32) as lo | hi << 32 (an epoch's seeds: about
 * 20 us through NumPy, 90 with cold caches). */
static PyObject *derive_seed_py(PyObject *self, PyObject *words) {
    uint32_t ent[32], st[2];
    if (!PyTuple_Check(words) || PyTuple_GET_SIZE(words) > 16)
        return PyErr_Format(PyExc_TypeError, "derive_seed: want a tuple of at most 16 ints");
    int n = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(words); i++) {
        PyObject *w = PyNumber_Index(PyTuple_GET_ITEM(words, i));
        if (w == NULL)
            return PyErr_Format(PyExc_TypeError, "derive_seed: word %zd is not an int", i);
        unsigned long long v = PyLong_AsUnsignedLongLongMask(w);
        Py_DECREF(w);
        if (v == (unsigned long long)-1 && PyErr_Occurred())
            return NULL;
        n += ss_words((uint64_t)v, ent + n);
    }
    seedseq_state(ent, n, st, 2);
    return PyLong_FromUnsignedLongLong((unsigned long long)st[0] |
                                       ((unsigned long long)st[1] << 32));
}

static PyObject *sample_words_py(PyObject *self, PyObject *args) {
    unsigned long long seed, epoch;
    Py_buffer idx, seeds, words;
    if (!PyArg_ParseTuple(args, "KKy*w*w*", &seed, &epoch, &idx, &seeds, &words))
        return NULL;
    Py_ssize_t b = idx.len / 8;
    PyObject *result = NULL;
    if (idx.len % 8 || seeds.len != b * 8 || words.len != b * 32) {
        PyErr_Format(PyExc_ValueError,
                     "sample_words: want (B,) int64 indices, (B,) uint64 seeds and (B, 4) "
                     "uint64 words, got %zd, %zd and %zd bytes", idx.len, seeds.len, words.len);
        goto done;
    }
    const int64_t *ix = (const int64_t *)idx.buf;
    for (Py_ssize_t j = 0; j < b; j++) {
        uint64_t s, w[4];
        sample_words_one(seed, epoch, (uint64_t)ix[j], &s, w);
        memcpy((char *)seeds.buf + 8 * j, &s, 8);
        memcpy((char *)words.buf + 32 * j, w, 32);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&idx);
    PyBuffer_Release(&seeds);
    PyBuffer_Release(&words);
    return result;
}

#ifdef __SIZEOF_INT128__
/* NumPy's PCG64 (numpy/random/src/pcg64/pcg64.h: XSL-RR 128/64, seeded by pcg64_set_seed)
 * and Generator.random()'s double: (next_uint64 >> 11) * 2**-53. */
typedef unsigned __int128 kuat_u128;
typedef struct {
    kuat_u128 state, inc;
    long long n; /* doubles drawn */
} kuat_pcg64;

static const kuat_u128 PCG_MULT =
    ((kuat_u128)0x2360ed051fc65da4ULL << 64) | (kuat_u128)0x4385df649fccf645ULL;

static void pcg64_seed(kuat_pcg64 *g, const uint64_t w[4]) {
    kuat_u128 initstate = ((kuat_u128)w[0] << 64) | w[1];
    kuat_u128 initseq = ((kuat_u128)w[2] << 64) | w[3];
    g->state = 0;
    g->n = 0;
    g->inc = (initseq << 1) | 1;
    g->state = g->state * PCG_MULT + g->inc;
    g->state += initstate;
    g->state = g->state * PCG_MULT + g->inc;
}

static double pcg64_double(kuat_pcg64 *g) {
    g->n++;
    g->state = g->state * PCG_MULT + g->inc;
    uint64_t x = (uint64_t)(g->state >> 64) ^ (uint64_t)g->state;
    unsigned rot = (unsigned)(g->state >> 122);
    uint64_t r = (x >> rot) | (x << ((-rot) & 63));
    return (double)(r >> 11) * (1.0 / 9007199254740992.0);
}

static long long py_round(double x) { return (long long)nearbyint(x); } /* half to even */

static long long floordiv(long long a, long long b) {
    long long q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

typedef struct {
    double scale_lo, scale_hi, log_lo, log_hi, ratio_lo, ratio_hi;
} rrc_params;

/* kuat.vision.transforms.RandomResizedCrop.get_params: (top, left, h, w). Returns 0 where
 * Python raises (a side inf or nan: round() of it, math.exp overflowing, a division by an
 * aspect of 0), 1 otherwise. */
static int rrc_box(kuat_pcg64 *g, long long height, long long width, const rrc_params *p,
                   long long box[4]) {
    double area = (double)(height * width);
    for (int attempt = 0; attempt < 10; attempt++) {
        double u_area = pcg64_double(g), u_ratio = pcg64_double(g);
        double target_area = area * (p->scale_lo + (p->scale_hi - p->scale_lo) * u_area);
        double aspect = exp(p->log_lo + (p->log_hi - p->log_lo) * u_ratio);
        double ws = sqrt(target_area * aspect), hs = sqrt(target_area / aspect);
        if (!isfinite(ws) || !isfinite(hs))
            return 0;
        /* a side past 2**62 fails the test below in Python too (converting it is undefined) */
        long long w = ws < 0x1p62 ? py_round(ws) : -1;
        long long h = hs < 0x1p62 ? py_round(hs) : -1;
        if (0 < w && w <= width && 0 < h && h <= height) {
            double u_i = pcg64_double(g), u_j = pcg64_double(g);
            long long i = (long long)(u_i * (double)(height - h + 1));
            long long j = (long long)(u_j * (double)(width - w + 1));
            box[0] = i < height - h ? i : height - h;
            box[1] = j < width - w ? j : width - w;
            box[2] = h;
            box[3] = w;
            return 1;
        }
    }
    double in_ratio = (double)width / (double)height;
    long long w = width, h = height;
    if (in_ratio < p->ratio_lo) {
        h = py_round((double)w / p->ratio_lo);
        h = h > 1 ? h : 1;
    } else if (in_ratio > p->ratio_hi) {
        w = py_round((double)h * p->ratio_hi);
        w = w > 1 ? w : 1;
    }
    box[0] = floordiv(height - h, 2);
    box[1] = floordiv(width - w, 2);
    box[2] = h;
    box[3] = w;
    return 1;
}

/* kuat.vision.geometry.snap */
static void snap_c(double start, double length, double scale, long long size, long long *a,
                   long long *b) {
    long long lo = py_round(start * scale);
    lo = lo > 0 ? lo : 0;
    lo = lo < size - 1 ? lo : size - 1;
    long long hi = py_round((start + length) * scale);
    hi = hi > lo + 1 ? hi : lo + 1;
    *a = lo;
    *b = hi < size ? hi : size;
}
#endif

static uint32_t be16(const uint8_t *p) { return ((uint32_t)p[0] << 8) | p[1]; }

/* kuat.vision._exif.tiff_orientation(buf[:n], start, end) */
static int tiff_orientation_c(const uint8_t *buf, Py_ssize_t n, Py_ssize_t start, Py_ssize_t end) {
    if (start + 6 <= n && memcmp(buf + start, "Exif\0\0", 6) == 0)
        start += 6;
    if (start + 2 > n)
        return 1;
    int le;
    if (buf[start] == 'I' && buf[start + 1] == 'I')
        le = 1;
    else if (buf[start] == 'M' && buf[start + 1] == 'M')
        le = 0;
    else
        return 1;
#define RD16(q) (le ? (uint32_t)buf[q] | ((uint32_t)buf[(q) + 1] << 8) : be16(buf + (q)))
#define RD32(q)                                                                                \
    (le ? (uint32_t)buf[q] | ((uint32_t)buf[(q) + 1] << 8) | ((uint32_t)buf[(q) + 2] << 16) |  \
              ((uint32_t)buf[(q) + 3] << 24)                                                   \
        : (be16(buf + (q)) << 16) | be16(buf + (q) + 2))
    if (start + 8 > n)
        return 1;
    long long p = (long long)start + RD32(start + 4);
    if (p + 2 > end)
        return 1;
    uint32_t count = RD16(p);
    if (count > 512)
        count = 512;
    for (uint32_t k = 0; k < count; k++) {
        long long q = p + 2 + 12LL * k;
        if (q + 12 > end)
            break;
        if (RD16(q) == 0x0112) {
            uint32_t typ = RD16(q + 2), value;
            if (typ == 3)
                value = RD16(q + 8);
            else if (typ == 4)
                value = RD32(q + 8);
            else
                return 1;
            return (value >= 1 && value <= 8) ? (int)value : 1;
        }
    }
    return 1;
#undef RD16
#undef RD32
}

/* The stored size, component count and EXIF orientation of a JPEG, walking its markers up to
 * the first scan as kuat.vision._exif.jpeg_segments / jpeg_orientation do. Returns 0 when
 * this walk cannot vouch for the header (no SOI, no frame before the scan, a broken segment,
 * a size of 0): the caller then plans in Python, which asks libjpeg. */
static int jpeg_walk(const uint8_t *b, Py_ssize_t n, long long *h, long long *w, int *ncomp,
                     int *orientation) {
    if (n < 4 || b[0] != 0xFF || b[1] != 0xD8)
        return 0;
    int have_sof = 0, have_exif = 0;
    *orientation = 1;
    Py_ssize_t pos = 2;
    while (pos + 4 <= n) {
        if (b[pos] != 0xFF)
            return 0;
        int marker = b[pos + 1];
        if (marker == 0xFF) {
            pos += 1;
            continue;
        }
        if (marker == 0x01 || (marker >= 0xD0 && marker <= 0xD8)) {
            pos += 2;
            continue;
        }
        if (marker == 0xD9)
            return 0;
        Py_ssize_t seglen = be16(b + pos + 2), end = pos + 2 + seglen;
        if (marker == 0xDA)
            return have_sof && *h > 0 && *w > 0;
        if (seglen < 2 || end > n)
            return 0;
        if (marker == 0xE1 && !have_exif && pos + 10 <= n && memcmp(b + pos + 4, "Exif\0\0", 6) == 0) {
            have_exif = 1;
            *orientation = tiff_orientation_c(b, n, pos + 10, end < n ? end : n);
        }
        if (marker >= 0xC0 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 &&
            marker != 0xCC) {
            if (have_sof || seglen < 8)
                return 0;
            have_sof = 1;
            *h = be16(b + pos + 5);
            *w = be16(b + pos + 7);
            *ncomp = b[pos + 9];
        }
        pos = end;
    }
    return 0;
}

/* One image of plan_rrc: its box (scale_num, y0, y1, x0, x1, flip) into box[6] and the
 * doubles drawn into *n_drawn (0 when not planned). Returns 0 where the per-image path must
 * take the image (not a baseline JPEG the ROI decoder takes, EXIF-rotated, over max_pixels, a
 * size Python refuses), 1 otherwise. `words`: the sample's 4 PCG64 seeding words (32 bytes,
 * any alignment). Calls no Python API. */
static int plan_one(const uint8_t *buf, Py_ssize_t len, long long width, long long height,
                    const char *words, const rrc_params *p, const double *flip_p, Py_ssize_t n_flips,
                    int out_h, int out_w, long long max_pixels, long long box6[6],
                    long long *n_drawn) {
    long long sh = 0, sw = 0;
    int ncomp = 0, orientation = 1;
    *n_drawn = 0;
    int ok = width > 0 && height > 0 && jpeg_walk(buf, len, &sh, &sw, &ncomp, &orientation) &&
             (ncomp == 1 || ncomp == 3) && (orientation == 1 || orientation == 2) &&
             (max_pixels < 0 || sh * sw <= max_pixels);
    kuat_pcg64 g = {0};
    long long box[4];
    if (!ok)
        return 0;
    uint64_t w4[4];
    memcpy(w4, words, 32);
    pcg64_seed(&g, w4);
    if (!rrc_box(&g, height, width, p, box)) /* Python raises: let it */
        return 0;
    int flip = 0;
    for (Py_ssize_t f = 0; f < n_flips; f++)
        if (pcg64_double(&g) < flip_p[f])
            flip = !flip;
    /* geometry.Plan.min_scale, decode.pick_scale */
    double bh = (double)box[2], bw = (double)box[3];
    double ms = fmax((double)out_h / bh, (double)out_w / bw);
    ms = ms < 1.0 ? ms : 1.0;
    int k = 8;
    for (int c = 1; c <= 8; c *= 2)
        if ((double)c >= 8.0 * ms - 1e-9) {
            k = c;
            break;
        }
    long long ph = (sh * k + 7) / 8, pw = (sw * k + 7) / 8;
    /* geometry.stored_crop_box for orientations 1 and 2 */
    double top = (double)box[0], left = (double)box[1];
    if (sw != width || sh != height) {
        double fy = (double)sh / (double)height, fx = (double)sw / (double)width;
        top *= fy;
        left *= fx;
        bh *= fy;
        bw *= fx;
    }
    if (orientation == 2)
        left = (double)sw - left - bw;
    double s = (double)k / 8.0;
    long long y0, y1, x0, x1;
    snap_c(top, bh, s, ph, &y0, &y1);
    snap_c(left, bw, s, pw, &x0, &x1);
    box6[0] = k, box6[1] = y0, box6[2] = y1, box6[3] = x0, box6[4] = x1;
    box6[5] = flip != (orientation == 2);
    *n_drawn = (long long)g.n;
    return 1;
}

/* The flip probabilities of `obj` (a sequence of floats; `what` is the TypeError's message
 * when it is not one): *n_flips its length, flip_p[f] for f < min(*n_flips, 16) (the callers
 * refuse more than 16). Read from a tuple (a list is copied first): a flip's __float__ may run
 * Python code that changes the caller's list, or any other list the caller reads, so read
 * those after this. 0, or -1 with an exception set. */
static int read_flips(PyObject *obj, const char *what, double *flip_p, Py_ssize_t *n_flips) {
    PyObject *flips = PySequence_Fast(obj, what);
    if (flips != NULL && PyList_CheckExact(flips)) {
        PyObject *t = PyList_AsTuple(flips);
        Py_DECREF(flips);
        flips = t;
    }
    if (flips == NULL)
        return -1;
    *n_flips = PySequence_Fast_GET_SIZE(flips);
    for (Py_ssize_t f = 0; f < *n_flips && f < 16; f++) {
        flip_p[f] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(flips, f));
        if (flip_p[f] == -1.0 && PyErr_Occurred()) {
            Py_DECREF(flips);
            return -1;
        }
    }
    Py_DECREF(flips);
    return 0;
}

static PyObject *plan_rrc(PyObject *self, PyObject *args) {
#ifndef __SIZEOF_INT128__
    PyErr_SetString(PyExc_NotImplementedError, "plan_rrc needs a compiler with 128-bit integers");
    return NULL;
#else
    PyObject *datas_obj, *flips_obj;
    Py_buffer wb, hb, wordsb, drawsb = {0};
    int out_h, out_w;
    rrc_params p;
    long long max_pixels;
    if (!PyArg_ParseTuple(args, "Oy*y*y*iiddddddOL|w*", &datas_obj, &wb, &hb, &wordsb, &out_h,
                          &out_w, &p.scale_lo, &p.scale_hi, &p.log_lo, &p.log_hi, &p.ratio_lo,
                          &p.ratio_hi, &flips_obj, &max_pixels, &drawsb))
        return NULL;
    PyObject *result = NULL, *datas = NULL;
    double flip_p[16];
    Py_ssize_t n_flips = 0;
    datas = PySequence_Fast(datas_obj, "plan_rrc: datas must be a sequence");
    if (datas == NULL ||
        read_flips(flips_obj, "plan_rrc: flip_ps must be a sequence", flip_p, &n_flips) < 0)
        goto done;
    /* B read after the flips (their __float__ may change a datas list) */
    Py_ssize_t b = PySequence_Fast_GET_SIZE(datas);
    if (wb.len != b * 8 || hb.len != b * 8 || wordsb.len != b * 32 || n_flips > 16 ||
        out_h <= 0 || out_w <= 0 || (drawsb.obj != NULL && drawsb.len != b * 8)) {
        PyErr_Format(PyExc_ValueError,
                     "plan_rrc: want B=%zd images, (B,) int64 widths and heights, (B, 4) uint64 "
                     "words, at most 16 flips, a positive output size and (B,) int64 draws", b);
        goto done;
    }
    result = PyList_New(b);
    if (result == NULL)
        goto done;
    const int64_t *widths = (const int64_t *)wb.buf, *heights = (const int64_t *)hb.buf;
    for (Py_ssize_t j = 0; j < b; j++) {
        PyObject *item = Py_None;
        Py_buffer data;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(datas, j), &data, PyBUF_SIMPLE) < 0) {
            PyErr_Clear(); /* not a contiguous buffer: the per-image path takes (or reports) it */
            Py_INCREF(item);
            PyList_SET_ITEM(result, j, item);
            continue;
        }
        long long box[6], n_drawn = 0;
        int ok = plan_one((const uint8_t *)data.buf, data.len, widths[j], heights[j],
                          (const char *)wordsb.buf + 32 * j, &p, flip_p, n_flips, out_h, out_w,
                          max_pixels, box, &n_drawn);
        PyBuffer_Release(&data);
        if (ok) {
            item = Py_BuildValue("iLLLLi", (int)box[0], box[1], box[2], box[3], box[4],
                                 (int)box[5]);
            if (item == NULL) {
                Py_CLEAR(result);
                goto done;
            }
        } else {
            Py_INCREF(item);
        }
        PyList_SET_ITEM(result, j, item);
        if (drawsb.obj != NULL)
            memcpy((char *)drawsb.buf + 8 * j, &n_drawn, 8);
    }
done:
    Py_XDECREF(datas);
    PyBuffer_Release(&wb);
    PyBuffer_Release(&hb);
    PyBuffer_Release(&wordsb);
    PyBuffer_Release(&drawsb);
    return result;
#endif
}

/* One image of plan_decode_rrc and plan_decode_rows: planned (plan_one) and, when planned,
 * decoded and resized into `slot` (3 x out_h x out_w). *code: -1 not planned (the per-image
 * path takes it), ROI_OK, or a decode failure with its reason in msg (ROI_MSG bytes). *tmp and
 * *tmp_size: the caller's scratch buffer, grown here (freed by the caller). Returns 1 when out
 * of memory (nothing more should be done), else 0. Calls no Python API. */
static int plan_decode_one(const uint8_t *buf, Py_ssize_t len, long long width, long long height,
                           const char *words, const rrc_params *p, const double *flip_p,
                           Py_ssize_t n_flips, int out_h, int out_w, long long max_pixels,
                           unsigned char *slot, unsigned char **tmp, size_t *tmp_size, int *code,
                           char *msg, long long *n_drawn) {
    long long box[6];
    *code = -1;
    if (!plan_one(buf, len, width, height, words, p, flip_p, n_flips, out_h, out_w, max_pixels,
                  box, n_drawn))
        return 0;
    int h = (int)(box[2] - box[1]), w = (int)(box[4] - box[3]);
    if (h <= 0 || w <= 0) { /* never planned so; the per-image path decides */
        *code = ROI_BAD_ARGS;
        snprintf(msg, ROI_MSG, "empty box %dx%d", w, h);
        return 0;
    }
    int32_t *xs = NULL, *ys = NULL;
    int16_t *xw = NULL, *yw = NULL;
    int xt, xp, yt, yp;
    size_t need = 3 * KUAT_TMP_ROWS(h) * out_w;
    if (need > *tmp_size) {
        free(*tmp);
        *tmp = (unsigned char *)malloc(need);
        *tmp_size = *tmp != NULL ? need : 0;
    }
    if (*tmp == NULL || taps_c(w, out_w, &xs, &xw, &xt, &xp) != 0 ||
        taps_c(h, out_h, &ys, &yw, &yt, &yp) != 0) {
        free(xs);
        return 1;
    }
    const size_t plane = KUAT_TMP_ROWS(h) * out_w;
    hpass hp;
    hpass_init(&hp, 4, out_w, (int)box[5], xs, xw, xt, xp, *tmp, plane);
    *code = roi_decode(buf, (size_t)len, (int)box[0], (unsigned)box[1], (unsigned)box[2],
                       (unsigned)box[3], (unsigned)box[4], NULL, 0, 4, &hp, msg);
    hpass_free(&hp);
    if (*code == ROI_OK)
        vertical_pass(*tmp, plane, slot, out_h, out_w, ys, yw, yt, yp);
    free(xs);
    free(ys);
    return 0;
}

/* The (unplanned, failed) answer of plan_decode_rrc / plan_decode_rows from each sample's code:
 * ROI_OK (decoded), -1 (not planned: the caller's per-image path takes it) or an error, whose
 * message is msgs[j * ROI_MSG]: ([j, ...], [(j, message), ...]); NULL with an exception set. */
static PyObject *planned_result(const int *codes, const char *msgs, Py_ssize_t b) {
    PyObject *result = NULL, *unplanned = PyList_New(0), *failed = PyList_New(0);
    for (Py_ssize_t j = 0; unplanned != NULL && failed != NULL && j < b; j++) {
        PyObject *item = NULL;
        if (codes[j] == ROI_OK)
            continue;
        if (codes[j] == -1) {
            item = PyLong_FromSsize_t(j);
            if (item == NULL || PyList_Append(unplanned, item) != 0)
                Py_CLEAR(unplanned);
        } else {
            item = Py_BuildValue("(ns)", j, msgs + (size_t)j * ROI_MSG);
            if (item == NULL || PyList_Append(failed, item) != 0)
                Py_CLEAR(failed);
        }
        Py_XDECREF(item);
    }
    if (unplanned != NULL && failed != NULL)
        result = PyTuple_Pack(2, unplanned, failed);
    Py_XDECREF(unplanned);
    Py_XDECREF(failed);
    return result;
}

/* plan_decode_rrc(datas, widths, heights, words, out, out_h, out_w, scale_lo, scale_hi,
 * log_ratio_lo, log_ratio_hi, ratio_lo, ratio_hi, flip_ps, max_pixels, draws,
 * unhashed=None) -> (unplanned, failed): plan_rrc, then decode_resize_batch of every planned image into its
 * own slot out[j] (its resize weights computed here, as kuat.vision.resize.taps), in one call
 * that holds the GIL only to take the B buffers and to build the answer: the header walks,
 * draws, boxes, weights, decodes and resizes all run with it released. The same boxes, draws
 * and pixels as plan_rrc + decode_resize_batch. `unplanned`: the j plan_rrc gives None (the
 * per-image path takes them); `failed`: (j, reason) for each planned image that could not be
 * decoded (its slot left as it was, draws[j] as planned). `draws`: (B,) int64, written.
 * unhashed = (seed, epoch): `words` is then the (B,) int64 sample indices, and each sample's
 * words are hashed here, without the GIL (sample_words' values). */
static PyObject *plan_decode_rrc(PyObject *self, PyObject *args) {
#ifndef __SIZEOF_INT128__
    PyErr_SetString(PyExc_NotImplementedError, "plan_decode_rrc needs 128-bit integers");
    return NULL;
#else
    if (kj.read_scanlines == NULL)
        return PyErr_Format(PyExc_RuntimeError, "no libjpeg loaded: call load(path) first");
    PyObject *datas_obj, *flips_obj, *unhashed = Py_None;
    Py_buffer wb, hb, wordsb, out, drawsb;
    int out_h, out_w;
    rrc_params p;
    long long max_pixels;
    unsigned long long ss_seed = 0, ss_epoch = 0;
    if (!PyArg_ParseTuple(args, "Oy*y*y*w*iiddddddOLw*|O", &datas_obj, &wb, &hb, &wordsb, &out,
                          &out_h, &out_w, &p.scale_lo, &p.scale_hi, &p.log_lo, &p.log_hi,
                          &p.ratio_lo, &p.ratio_hi, &flips_obj, &max_pixels, &drawsb, &unhashed))
        return NULL;
    /* unhashed = (seed, epoch): `words` holds the (B,) int64 sample indices instead, and each
     * sample's PCG64 words are hashed here without the GIL (sample_words_one: the same words) */
    const int hash_here = unhashed != Py_None;
    if (hash_here && !PyArg_ParseTuple(unhashed, "KK", &ss_seed, &ss_epoch)) {
        PyBuffer_Release(&wb);
        PyBuffer_Release(&hb);
        PyBuffer_Release(&wordsb);
        PyBuffer_Release(&out);
        PyBuffer_Release(&drawsb);
        return NULL;
    }
    PyObject *result = NULL, *datas = NULL;
    Py_buffer *bufs = NULL;
    char *held = NULL, *msgs = NULL;
    int *codes = NULL;
    double flip_p[16];
    Py_ssize_t b = 0, n_flips = 0;
    datas = PySequence_Fast(datas_obj, "plan_decode_rrc: datas must be a sequence");
    if (datas == NULL || read_flips(flips_obj, "plan_decode_rrc: flip_ps must be a sequence",
                                    flip_p, &n_flips) < 0)
        goto done;
    b = PySequence_Fast_GET_SIZE(datas); /* after the flips (their __float__ may change it) */
    const size_t slot_bytes = (size_t)3 * (size_t)(out_h > 0 ? out_h : 0) * (out_w > 0 ? out_w : 0);
    if (wb.len != b * 8 || hb.len != b * 8 || wordsb.len != b * (hash_here ? 8 : 32) || n_flips > 16 ||
        out_h <= 0 || out_w <= 0 || drawsb.len != b * 8 || (size_t)out.len < slot_bytes * b) {
        PyErr_Format(PyExc_ValueError,
                     "plan_decode_rrc: want B=%zd images, (B,) int64 widths and heights, (B, 4) "
                     "uint64 words (or (B,) int64 indices with unhashed), a (B, 3, out_h, out_w) uint8 out, at most 16 flips, a "
                     "positive output size and (B,) int64 draws", b);
        goto done;
    }
    bufs = (Py_buffer *)calloc(b > 0 ? b : 1, sizeof(Py_buffer));
    held = (char *)calloc(b > 0 ? b : 1, 1);
    codes = (int *)calloc(b > 0 ? b : 1, sizeof(int));
    msgs = (char *)calloc(b > 0 ? b : 1, ROI_MSG);
    if (bufs == NULL || held == NULL || codes == NULL || msgs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < b; j++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(datas, j), &bufs[j], PyBUF_SIMPLE) < 0)
            PyErr_Clear(); /* not a contiguous buffer: the per-image path takes (or reports) it */
        else
            held[j] = 1;
    }
    const int64_t *widths = (const int64_t *)wb.buf, *heights = (const int64_t *)hb.buf;
    int oom = 0;
    Py_BEGIN_ALLOW_THREADS
    unsigned char *tmp_buf = NULL;
    size_t tmp_size = 0;
    for (Py_ssize_t j = 0; j < b; j++) /* all the batch's pages read at once */
        if (held[j])
            advise_willneed(bufs[j].buf, (size_t)bufs[j].len);
    for (Py_ssize_t j = 0; j < b && !oom; j++) {
        long long n_drawn = 0;
        uint64_t own_words[4], own_seed;
        const char *words_j = (const char *)wordsb.buf + 32 * j;
        if (hash_here) {
            sample_words_one(ss_seed, ss_epoch, (uint64_t)((const int64_t *)wordsb.buf)[j],
                             &own_seed, own_words);
            words_j = (const char *)own_words;
        }
        codes[j] = -1; /* not planned */
        if (held[j])
            oom = plan_decode_one((const uint8_t *)bufs[j].buf, bufs[j].len, widths[j],
                                  heights[j], words_j, &p, flip_p, n_flips, out_h, out_w,
                                  max_pixels, (unsigned char *)out.buf + slot_bytes * j,
                                  &tmp_buf, &tmp_size, &codes[j], msgs + (size_t)j * ROI_MSG,
                                  &n_drawn);
        memcpy((char *)drawsb.buf + 8 * j, &n_drawn, 8);
    }
    free(tmp_buf);
    Py_END_ALLOW_THREADS
    if (oom) {
        PyErr_NoMemory();
        goto done;
    }
    result = planned_result(codes, msgs, b);
done:
    for (Py_ssize_t j = 0; held != NULL && j < b; j++)
        if (held[j])
            PyBuffer_Release(&bufs[j]);
    free(bufs);
    free(held);
    free(codes);
    free(msgs);
    Py_XDECREF(datas);
    PyBuffer_Release(&wb);
    PyBuffer_Release(&hb);
    PyBuffer_Release(&wordsb);
    PyBuffer_Release(&out);
    PyBuffer_Release(&drawsb);
    return result;
#endif
}

/* One shard's image column, as plan_decode_rows holds it while it decodes. */
typedef struct {
    long long k; /* shard id; -1: an empty slot of the table */
    Py_buffer data, off, wid, hei;
    Py_ssize_t n_rows;
} held_shard;

static void release_shards(held_shard *hs, Py_ssize_t n) {
    for (Py_ssize_t i = 0; hs != NULL && i < n; i++)
        if (hs[i].k >= 0) {
            PyBuffer_Release(&hs[i].data);
            PyBuffer_Release(&hs[i].off);
            PyBuffer_Release(&hs[i].wid);
            PyBuffer_Release(&hs[i].hei);
        }
}

#ifdef __SIZEOF_INT128__
static double seconds_of(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#define ROWS_MAX_THREADS 64 /* a split fetch's threads, at most */

/* decode_rows' decodes, shared by the threads of one call: each takes the next row not yet
 * taken (an atomic counter: images differ in cost, so no thread waits on a fixed share) and
 * plans and decodes it into its own slot. A row's pixels depend only on its data and its
 * sample words, never on the thread that takes it. */
typedef struct {
    const uint8_t *const *ptrs;
    const Py_ssize_t *lens;
    const int64_t *sizes, *ix;
    const rrc_params *p;
    const double *flip_p;
    Py_ssize_t n_flips, b, next; /* next: the next row to take (atomic) */
    int out_h, out_w, oom;       /* oom: set (atomic) when a thread ran out of memory */
    long long max_pixels;
    unsigned long long ss_seed, ss_epoch;
    unsigned char *out;
    size_t slot_bytes;
    int *codes;
    char *msgs;
} rows_job;

typedef struct {
    rows_job *job;
    pthread_t tid;
    double busy_s, cpu_s; /* a helper's wall and CPU seconds, for the loader's stats() */
} rows_helper;

/* Rows of `job` until none is left (or a thread ran out of memory). Calls no Python API. */
static void rows_take(rows_job *job) {
    unsigned char *tmp_buf = NULL;
    size_t tmp_size = 0;
    for (;;) {
        if (__atomic_load_n(&job->oom, __ATOMIC_RELAXED))
            break;
        const Py_ssize_t j = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (j >= job->b)
            break;
        long long n_drawn = 0;
        uint64_t words[4], own_seed;
        sample_words_one(job->ss_seed, job->ss_epoch, (uint64_t)job->ix[j], &own_seed, words);
        if (plan_decode_one(job->ptrs[j], job->lens[j], job->sizes[2 * j],
                            job->sizes[2 * j + 1], (const char *)words, job->p, job->flip_p,
                            job->n_flips, job->out_h, job->out_w, job->max_pixels,
                            job->out + job->slot_bytes * j, &tmp_buf, &tmp_size, &job->codes[j],
                            job->msgs + (size_t)j * ROI_MSG, &n_drawn))
            __atomic_store_n(&job->oom, 1, __ATOMIC_RELAXED);
    }
    free(tmp_buf);
}

static void *rows_helper_main(void *arg) {
    rows_helper *h = (rows_helper *)arg;
    const double wall0 = seconds_of(CLOCK_MONOTONIC), cpu0 = seconds_of(CLOCK_THREAD_CPUTIME_ID);
    rows_take(h->job);
    h->busy_s = seconds_of(CLOCK_MONOTONIC) - wall0;
    h->cpu_s = seconds_of(CLOCK_THREAD_CPUTIME_ID) - cpu0;
    return NULL;
}

/* The rows of `job` decoded by the calling thread and up to threads - 1 helper threads
 * started for this call and joined before it returns (none outlives it; where one cannot be
 * started, the others take its rows). Adds the helpers' wall and CPU seconds to *busy_s and
 * *cpu_s. Called with the GIL released. */
static void rows_run(rows_job *job, int threads, double *busy_s, double *cpu_s) {
    rows_helper helpers[ROWS_MAX_THREADS];
    int started = 0;
    if (threads > ROWS_MAX_THREADS)
        threads = ROWS_MAX_THREADS;
    if (threads > job->b)
        threads = (int)job->b;
    for (int k = 0; k + 1 < threads; k++) {
        helpers[started].job = job;
        helpers[started].busy_s = helpers[started].cpu_s = 0.0;
        if (pthread_create(&helpers[started].tid, NULL, rows_helper_main, &helpers[started]) != 0)
            break;
        started++;
    }
    rows_take(job);
    for (int k = 0; k < started; k++) {
        pthread_join(helpers[k].tid, NULL);
        *busy_s += helpers[k].busy_s;
        *cpu_s += helpers[k].cpu_s;
    }
}

/* plan_decode_rows' work on rows (sid[j], loc[j]) of `tables`, sample indices ix[j], into `out`
 * (the caller checked that sid, loc and ix hold B values each): a new reference, (unplanned,
 * failed) or the first unmapped shard k, or NULL with an exception set. `threads`,
 * helper_busy_s and helper_cpu_s: rows_run's (helper_busy_s NULL: not counted); kernel_s and
 * kernel_cpu_s (NULL: not read): the wall and this thread's CPU seconds of the decodes, read
 * with the GIL released. */
static PyObject *decode_rows(PyObject *tables, const int64_t *sid, const int64_t *loc,
                             const int64_t *ix, Py_ssize_t b, Py_buffer *out, int out_h,
                             int out_w, const rrc_params *p, PyObject *flips_obj,
                             long long max_pixels, unsigned long long ss_seed,
                             unsigned long long ss_epoch, int threads, double *helper_busy_s,
                             double *helper_cpu_s, double *kernel_s, double *kernel_cpu_s) {
    PyObject *result = NULL;
    held_shard *hs = NULL;
    Py_ssize_t n_slots = 0;
    const uint8_t **ptrs = NULL;
    Py_ssize_t *lens = NULL;
    int64_t *sizes = NULL;
    int *codes = NULL;
    char *msgs = NULL;
    double flip_p[16];
    const size_t slot_bytes = (size_t)3 * (size_t)(out_h > 0 ? out_h : 0) * (out_w > 0 ? out_w : 0);
    Py_ssize_t n_flips = 0;
    if (read_flips(flips_obj, "plan_decode_rows: flip_ps must be a sequence", flip_p,
                   &n_flips) < 0)
        goto done;
    if (n_flips > 16 || out_h <= 0 || out_w <= 0 || (size_t)out->len != slot_bytes * (size_t)b) {
        PyErr_Format(PyExc_ValueError,
                     "plan_decode_rows: want a (B, 3, out_h, out_w) uint8 out (B = %zd, %zd "
                     "bytes), at most 16 flips and a positive output size", b, out->len);
        goto done;
    }
    /* read after the flips: their sequence and __float__ may run Python code that changes
     * the list (no Python code runs from here until the tables are read) */
    const Py_ssize_t n_shards = PyList_GET_SIZE(tables);
    /* the batch's shards in an open-addressed table of a power of two >= 2B slots */
    n_slots = 16;
    while (n_slots < 2 * b)
        n_slots *= 2;
    hs = (held_shard *)malloc((size_t)n_slots * sizeof(held_shard));
    ptrs = (const uint8_t **)malloc((size_t)(b > 0 ? b : 1) * sizeof(*ptrs));
    lens = (Py_ssize_t *)malloc((size_t)(b > 0 ? b : 1) * sizeof(*lens));
    sizes = (int64_t *)malloc((size_t)(b > 0 ? b : 1) * 2 * sizeof(*sizes));
    codes = (int *)malloc((size_t)(b > 0 ? b : 1) * sizeof(int));
    msgs = (char *)calloc((size_t)(b > 0 ? b : 1), ROI_MSG);
    for (Py_ssize_t i = 0; hs != NULL && i < n_slots; i++)
        hs[i].k = -1;
    if (hs == NULL || ptrs == NULL || lens == NULL || sizes == NULL || codes == NULL ||
        msgs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < b; j++) {
        long long k = sid[j], r = loc[j];
        if (k < 0 || k >= n_shards) {
            PyErr_Format(PyExc_ValueError, "plan_decode_rows: shard %lld of %zd", k, n_shards);
            goto done;
        }
        Py_ssize_t s = (Py_ssize_t)((unsigned long long)k * 0x9E3779B97F4A7C15ULL >> 17) &
                       (n_slots - 1);
        while (hs[s].k >= 0 && hs[s].k != k)
            s = (s + 1) & (n_slots - 1);
        held_shard *h = &hs[s];
        if (h->k < 0) {
            PyObject *t = PyList_GET_ITEM(tables, k);
            if (t == Py_None) {
                result = PyLong_FromLongLong(k);
                goto done;
            }
            if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 4) {
                PyErr_SetString(PyExc_TypeError, "plan_decode_rows: a shard's entry is (view, "
                                "offsets, width, height)");
                goto done;
            }
            if (PyObject_GetBuffer(PyTuple_GET_ITEM(t, 0), &h->data, PyBUF_SIMPLE) < 0)
                goto done;
            if (PyObject_GetBuffer(PyTuple_GET_ITEM(t, 1), &h->off, PyBUF_SIMPLE) < 0) {
                PyBuffer_Release(&h->data);
                goto done;
            }
            if (PyObject_GetBuffer(PyTuple_GET_ITEM(t, 2), &h->wid, PyBUF_SIMPLE) < 0) {
                PyBuffer_Release(&h->data);
                PyBuffer_Release(&h->off);
                goto done;
            }
            if (PyObject_GetBuffer(PyTuple_GET_ITEM(t, 3), &h->hei, PyBUF_SIMPLE) < 0) {
                PyBuffer_Release(&h->data);
                PyBuffer_Release(&h->off);
                PyBuffer_Release(&h->wid);
                goto done;
            }
            h->k = k;
            h->n_rows = h->off.len / 4 - 1;
            if (h->n_rows < 0 || h->wid.len < h->n_rows * 4 || h->hei.len < h->n_rows * 4) {
                PyErr_Format(PyExc_ValueError, "plan_decode_rows: shard %lld's offsets, widths "
                             "and heights do not fit (%zd, %zd, %zd bytes)", k, h->off.len,
                             h->wid.len, h->hei.len);
                goto done;
            }
        }
        const int32_t *off = (const int32_t *)h->off.buf;
        if (r < 0 || r >= h->n_rows || off[r] < 0 || off[r] > off[r + 1] ||
            off[r + 1] > h->data.len) {
            PyErr_Format(PyExc_ValueError, "plan_decode_rows: row %lld outside shard %lld (%zd "
                         "rows)", r, k, h->n_rows);
            goto done;
        }
        ptrs[j] = (const uint8_t *)h->data.buf + off[r];
        lens[j] = (Py_ssize_t)(off[r + 1] - off[r]);
        sizes[2 * j] = ((const int32_t *)h->wid.buf)[r];
        sizes[2 * j + 1] = ((const int32_t *)h->hei.buf)[r];
    }
    rows_job job = {ptrs, lens, sizes, ix, p, flip_p, n_flips, b, 0, out_h, out_w, 0,
                    max_pixels, ss_seed, ss_epoch, (unsigned char *)out->buf, slot_bytes, codes,
                    msgs};
    double busy_s = 0.0, cpu_s = 0.0;
    Py_BEGIN_ALLOW_THREADS
    /* the kernel's clocks read without the GIL: a thread's CPU clock is a system call (1 us
     * warm, 15 after a wait on a 2-core VM), and what runs with the GIL held around the kernel
     * is the caller's Python time (what an outside reader of the GIL sees), not the kernel's */
    const double wall0 = kernel_s != NULL ? seconds_of(CLOCK_MONOTONIC) : 0.0;
    const double cpu0 = kernel_s != NULL ? seconds_of(CLOCK_THREAD_CPUTIME_ID) : 0.0;
    for (Py_ssize_t j = 0; j < b; j++) /* all the batch's pages read at once */
        advise_willneed(ptrs[j], (size_t)lens[j]);
    rows_run(&job, threads, &busy_s, &cpu_s);
    if (kernel_s != NULL) {
        *kernel_cpu_s = seconds_of(CLOCK_THREAD_CPUTIME_ID) - cpu0;
        *kernel_s = seconds_of(CLOCK_MONOTONIC) - wall0;
    }
    Py_END_ALLOW_THREADS
    if (helper_busy_s != NULL) {
        *helper_busy_s += busy_s;
        *helper_cpu_s += cpu_s;
    }
    if (job.oom) {
        PyErr_NoMemory();
        goto done;
    }
    result = planned_result(codes, msgs, b);
done:
    release_shards(hs, n_slots);
    free(hs);
    free(ptrs);
    free(lens);
    free(sizes);
    free(codes);
    free(msgs);
    return result;
}

#endif

/* plan_decode_rows(tables, sid, local, idx, out, out_h, out_w, scale_lo, scale_hi,
 * log_ratio_lo, log_ratio_hi, ratio_lo, ratio_hi, flip_ps, max_pixels, seed, epoch)
 *   -> (unplanned, failed) or k
 * plan_decode_rrc with the unhashed words (seed, epoch), for a batch given as rows of a kuat
 * image column instead of B views and sizes: `tables` is image_rows' (per shard None or
 * (view, offsets, width, height)), `sid` and `local` (B,) int64 each row's shard and row in it,
 * `idx` (B,) int64 the sample indices (hashed into each sample's words). Each row's bytes and
 * oriented size are read from its shard's column here: no per-row Python object, no (B,)
 * array made. The same boxes and pixels as image_rows then plan_decode_rrc (no draws: a
 * sample the per-image path takes was drawn from by nothing). Returns the first shard k of the
 * batch whose entry is None (nothing decoded: the caller maps it, or gathers the views), else
 * (unplanned, failed) as plan_decode_rrc. ValueError: a shard id, row or offsets out of range,
 * or sizes that do not fit. Holds the GIL only to take the shards' buffers and to build the
 * answer. */
static PyObject *plan_decode_rows(PyObject *self, PyObject *args) {
#ifndef __SIZEOF_INT128__
    PyErr_SetString(PyExc_NotImplementedError, "plan_decode_rows needs 128-bit integers");
    return NULL;
#else
    if (kj.read_scanlines == NULL)
        return PyErr_Format(PyExc_RuntimeError, "no libjpeg loaded: call load(path) first");
    PyObject *tables, *flips_obj;
    Py_buffer sidb, locb, idxb, out;
    int out_h, out_w;
    rrc_params p;
    long long max_pixels;
    unsigned long long ss_seed, ss_epoch;
    if (!PyArg_ParseTuple(args, "O!y*y*y*w*iiddddddOLKK", &PyList_Type, &tables, &sidb, &locb,
                          &idxb, &out, &out_h, &out_w, &p.scale_lo, &p.scale_hi, &p.log_lo,
                          &p.log_hi, &p.ratio_lo, &p.ratio_hi, &flips_obj, &max_pixels,
                          &ss_seed, &ss_epoch))
        return NULL;
    PyObject *result = NULL;
    if (sidb.len % 8 || locb.len != sidb.len || idxb.len != sidb.len)
        PyErr_Format(PyExc_ValueError, "plan_decode_rows: want (B,) int64 sid, local and idx "
                     "(%zd, %zd and %zd bytes)", sidb.len, locb.len, idxb.len);
    else
        result = decode_rows(tables, (const int64_t *)sidb.buf, (const int64_t *)locb.buf,
                             (const int64_t *)idxb.buf, sidb.len / 8, &out, out_h, out_w, &p,
                             flips_obj, max_pixels, ss_seed, ss_epoch, 1, NULL, NULL, NULL, NULL);
    PyBuffer_Release(&sidb);
    PyBuffer_Release(&locb);
    PyBuffer_Release(&idxb);
    PyBuffer_Release(&out);
    return result;
#endif
}

/* take_rows(columns, sid, local, out) -> -1 or k
 *   columns  list of S entries, one per shard: a C-contiguous buffer holding that shard's
 *            column (rows of itemsize bytes, end to end), or None (shard not mapped yet)
 *   sid, local  (B,) int64: each row's shard and its row within that shard
 *   out      writable C-contiguous buffer of B * itemsize bytes
 * Copies row local[j] of columns[sid[j]] to row j of out, for every j: a fixed-size field
 * (scalar, bool, tensor) gathered across shards in one call, no per-row or per-shard Python.
 * Returns -1 when done, else the first shard k whose entry is None (rows from the first row
 * of that shard on are not written: the caller maps shard k and calls again). ValueError: a
 * shard id or row out of range, or sizes that do not fit. Holds the GIL (a memcpy per row). */
/* take_rows' copy of rows (sid[j], loc[j]), j < b, into `out` (B * itemsize bytes): -1 when
 * done, the first unmapped shard k, or -2 with an exception set. */
static long long take_located(PyObject *cols, const int64_t *sid, const int64_t *loc,
                              Py_ssize_t b, Py_buffer *out) {
    long long result = -2, cur_k = -1;
    int have = 0;
    Py_buffer cur;
    const Py_ssize_t n_shards = PyList_GET_SIZE(cols);
    if ((b > 0 && out->len % b) || (b == 0 && out->len)) {
        PyErr_Format(PyExc_ValueError, "take_rows: want an out of %zd rows, got %zd bytes", b,
                     out->len);
        return -2;
    }
    const size_t itemsize = b > 0 ? (size_t)(out->len / b) : 0;
    for (Py_ssize_t j = 0; j < b; j++) {
        long long k = sid[j], r = loc[j];
        if (k != cur_k) {
            if (k < 0 || k >= n_shards) {
                PyErr_Format(PyExc_ValueError, "take_rows: shard %lld of %zd", k, n_shards);
                goto done;
            }
            if (have)
                PyBuffer_Release(&cur);
            have = 0;
            PyObject *col = PyList_GET_ITEM(cols, k);
            if (col == Py_None) {
                result = k;
                goto done;
            }
            if (PyObject_GetBuffer(col, &cur, PyBUF_SIMPLE) < 0)
                goto done;
            have = 1;
            cur_k = k;
        }
        if (r < 0 || (size_t)r >= (size_t)cur.len / (itemsize ? itemsize : 1)) {
            PyErr_Format(PyExc_ValueError, "take_rows: row %lld outside shard %lld's column of "
                         "%zd bytes (%zu per row)", r, k, cur.len, itemsize);
            goto done;
        }
        memcpy((char *)out->buf + (size_t)j * itemsize,
               (const char *)cur.buf + (size_t)r * itemsize, itemsize);
    }
    result = -1;
done:
    if (have)
        PyBuffer_Release(&cur);
    return result;
}

static PyObject *take_rows(PyObject *self, PyObject *args) {
    PyObject *cols;
    Py_buffer sidb, locb, out;
    if (!PyArg_ParseTuple(args, "O!y*y*w*", &PyList_Type, &cols, &sidb, &locb, &out))
        return NULL;
    PyObject *result = NULL;
    if (sidb.len % 8 || locb.len != sidb.len) {
        PyErr_Format(PyExc_ValueError,
                     "take_rows: want (B,) int64 sid and local and an out of B rows, got %zd, "
                     "%zd and %zd bytes", sidb.len, locb.len, out.len);
    } else {
        long long k = take_located(cols, (const int64_t *)sidb.buf, (const int64_t *)locb.buf,
                                   sidb.len / 8, &out);
        result = k == -2 ? NULL : PyLong_FromLongLong(k);
    }
    PyBuffer_Release(&sidb);
    PyBuffer_Release(&locb);
    PyBuffer_Release(&out);
    return result;
}

/* image_rows(tables, sid, local, width_out, height_out) -> list or k
 *   tables   list of S entries, one per shard: None (not mapped yet) or a tuple (view, offsets,
 *            width, height) of that shard's image column: view a memoryview of its encoded
 *            bytes, offsets its (n + 1,) int32 row offsets into them, width and height its
 *            (n,) int32 oriented sizes
 *   sid, local  (B,) int64: each row's shard and its row within that shard
 *   width_out, height_out  writable (B,) int32
 * Returns the B zero-copy views view[offsets[r]:offsets[r + 1]] (each keeps its shard mapped)
 * and writes each row's width and height: the image column of a batch gathered across shards
 * in one call. Or the first shard k whose entry is None (the caller maps it and calls again).
 * ValueError: a shard id, row or offsets out of range. */
static PyObject *image_rows(PyObject *self, PyObject *args) {
    PyObject *tables;
    Py_buffer sidb, locb, wout, hout, ob, wb, hb;
    if (!PyArg_ParseTuple(args, "O!y*y*w*w*", &PyList_Type, &tables, &sidb, &locb, &wout, &hout))
        return NULL;
    PyObject *result = NULL, *views = NULL, *view = NULL;
    int have = 0;
    long long cur_k = -1, missing = -1;
    Py_ssize_t b = sidb.len / 8, n_shards = PyList_GET_SIZE(tables), n_rows = 0, data_len = 0;
    if (sidb.len % 8 || locb.len != sidb.len || wout.len != b * 4 || hout.len != b * 4) {
        PyErr_Format(PyExc_ValueError, "image_rows: want (B,) int64 sid and local and (B,) "
                     "int32 width and height, got %zd, %zd, %zd and %zd bytes", sidb.len,
                     locb.len, wout.len, hout.len);
        goto done;
    }
    views = PyList_New(b);
    if (views == NULL)
        goto done;
    const int64_t *sid = (const int64_t *)sidb.buf, *loc = (const int64_t *)locb.buf;
    for (Py_ssize_t j = 0; j < b; j++) {
        long long k = sid[j], r = loc[j];
        if (k != cur_k) {
            if (k < 0 || k >= n_shards) {
                PyErr_Format(PyExc_ValueError, "image_rows: shard %lld of %zd", k, n_shards);
                goto done;
            }
            if (have) {
                PyBuffer_Release(&ob);
                PyBuffer_Release(&wb);
                PyBuffer_Release(&hb);
            }
            have = 0;
            PyObject *t = PyList_GET_ITEM(tables, k);
            if (t == Py_None) {
                missing = k;
                break;
            }
            if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 4) {
                PyErr_SetString(PyExc_TypeError,
                                "image_rows: a shard's entry is (view, offsets, width, height)");
                goto done;
            }
            view = PyTuple_GET_ITEM(t, 0);
            if (PyObject_GetBuffer(PyTuple_GET_ITEM(t, 1), &ob, PyBUF_SIMPLE) < 0)
                goto done;
            if (PyObject_GetBuffer(PyTuple_GET_ITEM(t, 2), &wb, PyBUF_SIMPLE) < 0) {
                PyBuffer_Release(&ob);
                goto done;
            }
            if (PyObject_GetBuffer(PyTuple_GET_ITEM(t, 3), &hb, PyBUF_SIMPLE) < 0) {
                PyBuffer_Release(&ob);
                PyBuffer_Release(&wb);
                goto done;
            }
            have = 1;
            cur_k = k;
            n_rows = ob.len / 4 - 1;
            data_len = PyObject_Length(view);
            if (data_len < 0)
                goto done;
            if (n_rows < 0 || wb.len < n_rows * 4 || hb.len < n_rows * 4) {
                PyErr_Format(PyExc_ValueError, "image_rows: shard %lld's offsets, widths and "
                             "heights do not fit (%zd, %zd, %zd bytes)", k, ob.len, wb.len, hb.len);
                goto done;
            }
        }
        const int32_t *off = (const int32_t *)ob.buf;
        if (r < 0 || r >= n_rows || off[r] < 0 || off[r] > off[r + 1] || off[r + 1] > data_len) {
            PyErr_Format(PyExc_ValueError, "image_rows: row %lld outside shard %lld (%zd rows)",
                         r, k, n_rows);
            goto done;
        }
        PyObject *item = PySequence_GetSlice(view, off[r], off[r + 1]);
        if (item == NULL)
            goto done;
        PyList_SET_ITEM(views, j, item);
        ((int32_t *)wout.buf)[j] = ((const int32_t *)wb.buf)[r];
        ((int32_t *)hout.buf)[j] = ((const int32_t *)hb.buf)[r];
    }
    if (missing >= 0)
        result = PyLong_FromLongLong(missing);
    else {
        result = views;
        views = NULL;
    }
done:
    if (have) {
        PyBuffer_Release(&ob);
        PyBuffer_Release(&wb);
        PyBuffer_Release(&hb);
    }
    Py_XDECREF(views);
    PyBuffer_Release(&sidb);
    PyBuffer_Release(&locb);
    PyBuffer_Release(&wout);
    PyBuffer_Release(&hout);
    return result;
}

/* locate_rows(starts, idx, sid_out, local_out) -> None
 *   starts  (S,) int64, ascending: each shard's first global row (starts[0] == 0)
 *   idx     (B,) int64 global rows, each in [0, total rows) (checked by the caller)
 *   sid_out, local_out  writable (B,) int64: each row's shard (the last k with
 *           starts[k] <= idx[j]) and its row within that shard
 * What np.searchsorted(starts, idx, "right") - 1 and idx - starts[sid] give, in one call.
 * ValueError: a row before starts[0], or sizes that do not fit. */
/* locate_rows' search: each row ix[j]'s shard sid[j] and row loc[j] in it, from the shards'
 * first rows st[0..n_shards); 0, or -1 with an exception set (a row before the first shard). */
static int locate(const int64_t *st, Py_ssize_t n_shards, const int64_t *ix, Py_ssize_t b,
                  int64_t *sid, int64_t *loc) {
    for (Py_ssize_t j = 0; j < b; j++) {
        int64_t i = ix[j];
        if (i < st[0]) {
            PyErr_Format(PyExc_ValueError, "locate_rows: row %lld before the first shard",
                         (long long)i);
            return -1;
        }
        Py_ssize_t lo_k = 0, hi_k = n_shards; /* the last k with st[k] <= i: in [lo_k, hi_k) */
        while (hi_k - lo_k > 1) {
            Py_ssize_t mid = lo_k + (hi_k - lo_k) / 2;
            if (st[mid] <= i)
                lo_k = mid;
            else
                hi_k = mid;
        }
        sid[j] = lo_k;
        loc[j] = i - st[lo_k];
    }
    return 0;
}

static PyObject *locate_rows(PyObject *self, PyObject *args) {
    Py_buffer sb, ib, so, lo;
    if (!PyArg_ParseTuple(args, "y*y*w*w*", &sb, &ib, &so, &lo))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n_shards = sb.len / 8, b = ib.len / 8;
    if (sb.len % 8 || n_shards == 0 || ib.len % 8 || so.len != ib.len || lo.len != ib.len) {
        PyErr_SetString(PyExc_ValueError, "locate_rows: want (S,) int64 starts (S >= 1) and (B,) "
                        "int64 rows, shard ids and local rows");
    } else if (locate((const int64_t *)sb.buf, n_shards, (const int64_t *)ib.buf, b,
                      (int64_t *)so.buf, (int64_t *)lo.buf) == 0) {
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&sb);
    PyBuffer_Release(&ib);
    PyBuffer_Release(&so);
    PyBuffer_Release(&lo);
    return result;
}

/* fetch_rows(indices, num_rows, starts, fixed, tables, out, out_h, out_w, scale_lo, scale_hi,
 * log_ratio_lo, log_ratio_hi, ratio_lo, ratio_hi, flip_ps, max_pixels, seed, epoch,
 * threads=1) -> None, k, or (unplanned, failed, wall_s, cpu_s, helper_busy_s, helper_cpu_s)
 * A kuat dataset's batch, from the sampler's list of indices to its finished columns, in one
 * call (kuat.sources._rows_fetch): `indices` a list of B Python ints, each checked to lie in
 * [0, num_rows) (else None is returned, nothing written: the caller's Python path raises or
 * takes them); their shards and rows located from `starts` ((S,) int64 each shard's first
 * row, as locate_rows); each (columns, out) pair of the list `fixed` gathered as take_rows;
 * then the image column's rows decoded into `out` as plan_decode_rows (`tables` and the rest
 * are its arguments; the GIL released once, for the decodes). Returns the first shard k whose
 * entry in a field's table is None (the fixed fields' outs may be partly written, no image
 * decoded: the caller maps it), else plan_decode_rows' (unplanned, failed) with the decodes'
 * wall and this thread's CPU seconds, read with the GIL released (kuat._native's totals).
 * `threads` > 1 (an epoch's first batch, kuat._parallel's width): the decodes are shared
 * with threads - 1 helper threads started and joined in the call, without the GIL
 * (rows_run); their summed wall and CPU seconds come last (0.0 without helpers). ValueError
 * and MemoryError as plan_decode_rows and take_rows. */
static PyObject *fetch_rows(PyObject *self, PyObject *args) {
#ifndef __SIZEOF_INT128__
    PyErr_SetString(PyExc_NotImplementedError, "fetch_rows needs 128-bit integers");
    return NULL;
#else
    if (kj.read_scanlines == NULL)
        return PyErr_Format(PyExc_RuntimeError, "no libjpeg loaded: call load(path) first");
    PyObject *indices, *fixed, *tables, *flips_obj;
    long long num_rows, max_pixels;
    Py_buffer stb, out;
    int out_h, out_w;
    rrc_params p;
    unsigned long long ss_seed, ss_epoch;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "O!Ly*O!O!w*iiddddddOLKK|i", &PyList_Type, &indices, &num_rows,
                          &stb, &PyList_Type, &fixed, &PyList_Type, &tables, &out, &out_h,
                          &out_w, &p.scale_lo, &p.scale_hi, &p.log_lo, &p.log_hi, &p.ratio_lo,
                          &p.ratio_hi, &flips_obj, &max_pixels, &ss_seed, &ss_epoch, &threads))
        return NULL;
    double helper_busy_s = 0.0, helper_cpu_s = 0.0;
    PyObject *result = NULL;
    const Py_ssize_t b = PyList_GET_SIZE(indices), n_shards = stb.len / 8;
    int64_t *ix = (int64_t *)malloc((size_t)(b > 0 ? b : 1) * 3 * sizeof(int64_t));
    if (ix == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *sid = ix + b, *loc = ix + 2 * b;
    /* the indices first: an empty dataset (no shard, no start) refuses every index as any
     * dataset refuses one out of range, with the caller's IndexError */
    for (Py_ssize_t j = 0; j < b; j++) {
        PyObject *o = PyList_GET_ITEM(indices, j);
        int overflow = 0;
        long long v = PyLong_CheckExact(o) ? PyLong_AsLongLongAndOverflow(o, &overflow) : -1;
        if (overflow || v < 0 || v >= num_rows) { /* not an int in range: the caller's path */
            PyErr_Clear();
            result = Py_None;
            Py_INCREF(result);
            goto done;
        }
        ix[j] = v;
    }
    if (b == 0) {
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    if (stb.len % 8 || n_shards == 0) {
        PyErr_SetString(PyExc_ValueError, "fetch_rows: want (S,) int64 starts (S >= 1)");
        goto done;
    }
    if (locate((const int64_t *)stb.buf, n_shards, ix, b, sid, loc) != 0)
        goto done;
    for (Py_ssize_t f = 0; f < PyList_GET_SIZE(fixed); f++) {
        PyObject *pair = PyList_GET_ITEM(fixed, f);
        Py_buffer col_out;
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 ||
            !PyList_Check(PyTuple_GET_ITEM(pair, 0))) {
            PyErr_SetString(PyExc_TypeError, "fetch_rows: fixed holds (columns, out) pairs");
            goto done;
        }
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(pair, 1), &col_out, PyBUF_WRITABLE) < 0)
            goto done;
        long long k = take_located(PyTuple_GET_ITEM(pair, 0), sid, loc, b, &col_out);
        PyBuffer_Release(&col_out);
        if (k == -2)
            goto done;
        if (k >= 0) {
            result = PyLong_FromLongLong(k);
            goto done;
        }
    }
    double wall = 0.0, cpu = 0.0;
    PyObject *decoded = decode_rows(tables, sid, loc, ix, b, &out, out_h, out_w, &p, flips_obj,
                                    max_pixels, ss_seed, ss_epoch, threads, &helper_busy_s,
                                    &helper_cpu_s, &wall, &cpu);
    if (decoded == NULL || !PyTuple_Check(decoded)) {
        result = decoded; /* NULL, or the unmapped shard k */
        goto done;
    }
    result = Py_BuildValue("(OOdddd)", PyTuple_GET_ITEM(decoded, 0),
                           PyTuple_GET_ITEM(decoded, 1), wall, cpu, helper_busy_s, helper_cpu_s);
    Py_DECREF(decoded);
done:
    free(ix);
    PyBuffer_Release(&stb);
    PyBuffer_Release(&out);
    return result;
#endif
}

static PyObject *simd_py(PyObject *self, PyObject *args) {
    int level = -1;
    if (!PyArg_ParseTuple(args, "|i", &level))
        return NULL;
    if (level >= 0) {
        int best = simd_best();
        if (level > best)
            return PyErr_Format(PyExc_ValueError,
                                "resize kernel level %d is above what this CPU runs (%d)", level,
                                best);
        simd_level = level;
    }
    return PyLong_FromLong(simd());
}

static PyMethodDef methods[] = {
    {"locate_rows", locate_rows, METH_VARARGS,
     "locate_rows(starts, idx, sid_out, local_out) -> None: each row's shard and row in it"},
    {"take_rows", take_rows, METH_VARARGS,
     "take_rows(columns, sid, local, out) -> -1 or the first unmapped shard: rows of a "
     "fixed-size field gathered across shards"},
    {"image_rows", image_rows, METH_VARARGS,
     "image_rows(tables, sid, local, width_out, height_out) -> B views or the first unmapped "
     "shard: an image field's rows gathered across shards"},
    {"simd", simd_py, METH_VARARGS,
     "simd(level=-1) -> level: the resize kernels in use (0 C, 1 SSE2, 2 SSSE3, 3 AVX2); a "
     "level >= 0 sets it, at most the best this CPU runs. Not thread-safe: for tests and "
     "benchmarks, while nothing resizes"},
    {"load", load, METH_VARARGS,
     "load(path) -> (copyright, file): dlopen the libjpeg-turbo every decode uses"},
    {"taps", taps_py, METH_VARARGS,
     "taps(in_size, out_size) -> (start, weights, taps, precision): the fixed-point weights "
     "of kuat.vision.resize.taps, as bytes"},
    {"resize_planar", resize_planar, METH_VARARGS,
     "resize_planar(src, h, w, channels, out, out_h, out_w, flip, x_start, x_weights, x_taps, "
     "x_precision, y_start, y_weights, y_taps, y_precision) -> None"},
    {"decode_resize_batch", decode_resize_batch, METH_VARARGS,
     "decode_resize_batch(jobs, out, n_slots, out_h, out_w, next=None) -> [(job, message), ...]: "
     "each job "
     "(data, scale_num, y0, y1, x0, x1, slot, flip, x_start, x_weights, x_taps, x_precision, "
     "y_start, y_weights, y_taps, y_precision) decoded and resized into out[slot]"},
    {"derive_seed", derive_seed_py, METH_O,
     "derive_seed(words) -> int: kuat.rng.derive_seed's 64-bit value of a tuple of at most 16 "
     "ints, each taken modulo 2**64"},
    {"sample_words", sample_words_py, METH_VARARGS,
     "sample_words(seed, epoch, indices, seeds_out, words_out) -> None: kuat.rng's sample "
     "seeds and their PCG64 seeding words for (B,) int64 indices"},
    {"plan_rrc", plan_rrc, METH_VARARGS,
     "plan_rrc(datas, widths, heights, words, out_h, out_w, scale_lo, scale_hi, log_ratio_lo, "
     "log_ratio_hi, ratio_lo, ratio_hi, flip_ps, max_pixels, draws=None) -> [(scale_num, y0, "
     "y1, x0, x1, flip) or None, ...]: RandomResizedCrop(+flips) boxes on the decoded grid"},
    {"plan_decode_rrc", plan_decode_rrc, METH_VARARGS,
     "plan_decode_rrc(datas, widths, heights, words, out, out_h, out_w, scale_lo, scale_hi, "
     "log_ratio_lo, log_ratio_hi, ratio_lo, ratio_hi, flip_ps, max_pixels, draws) -> "
     "(unplanned, failed): plan_rrc then decode_resize_batch into out[j], the GIL released "
     "once"},
    {"plan_decode_rows", plan_decode_rows, METH_VARARGS,
     "plan_decode_rows(tables, sid, local, idx, out, out_h, out_w, scale_lo, scale_hi, "
     "log_ratio_lo, log_ratio_hi, ratio_lo, ratio_hi, flip_ps, max_pixels, seed, epoch) -> "
     "(unplanned, failed) or the first unmapped shard: plan_decode_rrc of an image column's "
     "rows, read from the shards' tables"},
    {"fetch_rows", fetch_rows, METH_VARARGS,
     "fetch_rows(indices, num_rows, starts, fixed, tables, out, out_h, out_w, scale_lo, "
     "scale_hi, log_ratio_lo, log_ratio_hi, ratio_lo, ratio_hi, flip_ps, max_pixels, seed, "
     "epoch, threads=1) -> None, the first unmapped shard, or (unplanned, failed, wall_s, "
     "cpu_s, helper_busy_s, helper_cpu_s): a kuat dataset's batch from its list of indices, "
     "fixed-size fields and one image column, in one call (its decodes shared by `threads` "
     "threads)"},
    {"decode_crop", decode_crop, METH_VARARGS,
     "decode_crop(data, scale_num, y0, y1, x0, x1, out, channels=3) -> None: the crop, contiguous"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_roijpeg",
                                    "ROI JPEG decoding with libjpeg-turbo", -1, methods};

PyMODINIT_FUNC PyInit__roijpeg(void) { return PyModule_Create(&module); }
