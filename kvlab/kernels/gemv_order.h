/* How kvlab's one-row products walk a weight matrix, per weight format: 1 = one weight row
 * after another (one memory stream a thread, which the hardware prefetchers follow alone),
 * 0 = four rows side by side with the next four prefetched in software. Which reads faster
 * depends on the CPU's prefetchers, so kvlab/models/gemv_order.py times both and sets it
 * through kvlab_gemv_set_order (gemv.c); rows until then. */
#ifndef KVLAB_GEMV_ORDER_H
#define KVLAB_GEMV_ORDER_H

enum { ORDER_FP32, ORDER_BF16, ORDER_INT8, ORDER_FORMATS };
extern int kvlab_rows_in_order[ORDER_FORMATS];

#endif
