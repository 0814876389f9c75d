#!/usr/bin/env python3
"""ep_dedup_layout.py - a host mirror of kcu_ep's deduplicated dispatch
layout (kernels/cuda/kcu_ep_dedup.cu's kernels and kcu_ep.cu's epd_plan
tables), run on random routings of W simulated ranks: every unique row goes
to one send slot, every GEMM row gets its input row and one return row,
the weight gradients' global rows cover each expert's range once, and each
slot's returned row is (its expert, its token). Written without a GPU to
check the index arithmetic; keep it in step with the kernels when they
change. Not run by make lint.

With ce=True, the copy-engine exchange's padded layout (kcu_ep.cu ce_slots,
epd_plan with ce_fwd): chunk c's dispatch slot Sd[c] (the most unique rows of
one (source, destination) pair), return slot R[c] (the most slot rows of one
(source, owner) pair), regions D[c], B[c]; the transfers are all-to-alls of
whole slots (ncclAlltoAll semantics: rank a's slot b lands in rank b's slot
a) and every row must land where the tables say, y as without it.

Usage: tools/ep_dedup_layout.py   exit 0 when every case passes (assert).
"""
import random

def first(E,W,q): return (E*q)//W
def owner(E,W,e):
    r=(e*W)//E
    while r+1<W and first(E,W,r+1)<=e: r+=1
    while r>0 and first(E,W,r)>e: r-=1
    return r
def part(t,T,n): return ((t+1)*n-1)//T

NT=256  # EPD_NT

def kernel_urank(mask,T,W):
    """k_epd_count's bcnt (per 256-token block), k_epd_scan, k_epd_rank"""
    nblk=(T+NT-1)//NT
    bcnt=[[sum(1 for t in range(b*NT,min(T,(b+1)*NT)) if mask[t]>>q&1) for q in range(W)]
          for b in range(nblk)]
    for q in range(W):  # k_epd_scan: exclusive prefix over the blocks
        run_=0
        for b in range(nblk): v=bcnt[b][q]; bcnt[b][q]=run_; run_+=v
    ur={}
    for b in range(nblk):
        for q in range(W):
            f=[(b*NT+i<T and mask[b*NT+i]>>q&1) for i in range(NT)]
            wsum=[sum(f[w*32:(w+1)*32]) for w in range(NT//32)]
            for i in range(NT):
                if f[i]:
                    w,lane=i//32,i%32
                    ur[(b*NT+i,q)]=bcnt[b][q]+sum(f[w*32:w*32+lane])+sum(wsum[:w])
    return ur

def run(W,E,K,Ts,C,P,seed,ce=False):
    rnd=random.Random(seed)
    BM=128
    ranks=[]
    # token side before exchange
    for me in range(W):
        T=Ts[me]
        idx=[]
        for t in range(T):
            idx+= rnd.sample(range(E),K)
        S=T*K
        # stable sort layout
        perm=sorted(range(S), key=lambda s:(idx[s],s))
        counts=[0]*E
        for s in range(S): counts[idx[s]]+=1
        offs=[0]*(E+1)
        for e in range(E): offs[e+1]=offs[e]+counts[e]
        # k_epd_count
        cnt=[0]*(P*(E+W)); mask=[0]*T
        for t in range(T):
            s_=part(t,T,P); m=0
            for k in range(K):
                e=idx[t*K+k]; cnt[s_*E+e]+=1; m|=1<<owner(E,W,e)
            mask[t]=m
            for q in range(W):
                if m>>q&1: cnt[P*E+s_*W+q]+=1
        # rank: global exclusive rank
        urank={}
        run_=[0]*W
        for t in range(T):
            for q in range(W):
                if mask[t]>>q&1: urank[(t,q)]=run_[q]; run_[q]+=1
        # the kernels' way (k_epd_count's per-block counts, k_epd_scan,
        # k_epd_rank's warp ballots) gives the same ranks
        assert urank==kernel_urank(mask,T,W)
        ranks.append(dict(T=T,idx=idx,perm=perm,offs=offs,cnt=cnt,mask=mask,urank=urank))
    cnt_h=[r['cnt'] for r in ranks]
    m=P//C
    def rows(q,c,e): return sum(cnt_h[q][s*E+e] for s in range(c*m,(c+1)*m))
    def uniq(q,c,d): return sum(cnt_h[q][P*E+s*W+d] for s in range(c*m,(c+1)*m))
    def owner_rows(q,c,o):
        a=first(E,W,o); b=first(E,W,o+1)
        return sum(rows(q,c,e) for e in range(a,b))
    # ce_slots: the same on every rank (from the gathered counts only)
    Sd=[max(uniq(q,c,d) for q in range(W) for d in range(W)) for c in range(C)]
    Rs=[max(owner_rows(q,c,o) for q in range(W) for o in range(W)) for c in range(C)]
    D=[0]; B=[0]
    for c in range(C): D.append(D[-1]+W*Sd[c]); B.append(B[-1]+W*Rs[c])
    real=sum(uniq(q,c,d)+owner_rows(q,c,d) for q in range(W) for c in range(C) for d in range(W))
    padded=W*(D[C]+B[C])
    assert padded>=real
    plans=[]
    for me in range(W):
        fst=first(E,W,me); ne=first(E,W,me+1)-fst
        send_rows=[[owner_rows(me,c,q) for q in range(W)] for c in range(C)]
        recv_rows=[[owner_rows(q,c,me) for q in range(W)] for c in range(C)]
        usend=[[uniq(me,c,q) for q in range(W)] for c in range(C)]
        urecv=[[uniq(q,c,me) for q in range(W)] for c in range(C)]
        sbase=[0];rbase=[0];usbase=[0];urbase=[0]
        for c in range(C):
            sbase.append(sbase[-1]+sum(send_rows[c])); rbase.append(rbase[-1]+sum(recv_rows[c]))
            usbase.append(usbase[-1]+sum(usend[c])); urbase.append(urbase[-1]+sum(urecv[c]))
        offsc=[];ctab={};cpre={};utab={};upre={};ur0={};urn={};goff={};roff={}
        for c in range(C):
            o=0; offs=[]
            for i in range(ne):
                n=sum(rows(q,c,fst+i) for q in range(W)); offs.append(o); o+=n
            offs.append(o); offsc.append(offs)
            pos=sbase[c]
            for e in range(E):
                if ce and e==first(E,W,owner(E,W,e)): pos=B[c]+owner(E,W,e)*Rs[c]
                ctab[(c,e)]=pos; cpre[(c,e)]=sum(rows(me,cc,e) for cc in range(c)); pos+=rows(me,c,e)
            upos=usbase[c]; rpos=urbase[c]; ret=0
            for q in range(W):
                if ce: upos=rpos=D[c]+q*Sd[c]
                utab[(c,q)]=upos; upre[(c,q)]=sum(usend[cc][q] for cc in range(c)); upos+=usend[c][q]
                ur0[(c,q)]=rpos; urn[(c,q)]=urecv[c][q]; rpos+=urecv[c][q]
                r_in=B[c]-rbase[c]+q*Rs[c] if ce else ret
                for i in range(ne):
                    g=offs[i]+sum(rows(qq,c,fst+i) for qq in range(q))
                    goff[(c,q,i)]=g; roff[(c,q,i)]=r_in; r_in+=rows(q,c,fst+i)
                ret+=recv_rows[c][q]
        # epd_plan's statistics equal the routing's
        cg=[sum(rows(q,c,e) for q in range(W) for c in range(C)) for e in range(E)]
        assert cg==[sum(ranks[q]['idx'].count(e) for q in range(W)) for e in range(E)]
        assert [sum(rows(me,c,e) for c in range(C)) for e in range(E)]==\
            [ranks[me]['idx'].count(e) for e in range(E)]
        assert sum(sum(rows(q,c,e) for c in range(C) for e in range(E))//K for q in range(W))==sum(Ts)
        assert urbase[C]<=rbase[C]  # xrecv / mrecv (ep_grow's rows) hold the unique rows
        # the chunks of the slices are the token chunks (epd_part with C)
        for c in range(C):
            assert (c*m*Ts[me])//P==(c*Ts[me])//C
        # tile lists (te, tr) of each chunk: KCU_BM-row tiles covering offs
        for c in range(C):
            offs=offsc[c]; te=[]; tr=[]
            for i in range(ne):
                for r0 in range(0,offs[i+1]-offs[i],BM): te.append(i); tr.append(offs[i]+r0)
            covered=[r for k in range(len(te)) for r in range(tr[k],min(tr[k]+BM,offs[te[k]+1]))]
            assert covered==list(range(offs[ne])) and offs[ne]==rbase[c+1]-rbase[c]
        plans.append(dict(fst=fst,ne=ne,send_rows=send_rows,recv_rows=recv_rows,usend=usend,urecv=urecv,
            sbase=sbase,rbase=rbase,usbase=usbase,urbase=urbase,offsc=offsc,ctab=ctab,cpre=cpre,utab=utab,
            upre=upre,ur0=ur0,urn=urn,goff=goff,roff=roff))
    # pack
    for me in range(W):
        R=ranks[me]; p=plans[me]; T=R['T']; S=T*K; idx=R['idx']
        sendpos=[None]*S
        for r in range(S):
            s=R['perm'][r]; e=idx[s]; c=part(s//K,T,C)
            j=r-R['offs'][e]-p['cpre'][(c,e)]
            assert 0<=j<rows(me,c,e)
            sendpos[s]=p['ctab'][(c,e)]+j
        assert len(set(sendpos))==S and (ce or sorted(sendpos)==list(range(S)))
        nus=D[C] if ce else p['usbase'][C]
        xsend=[None]*nus; msend=[None]*(nus*K)
        for t in range(T):
            c=part(t,T,C)
            for q in range(W):
                if not (R['mask'][t]>>q&1): continue
                u=p['utab'][(c,q)]+R['urank'][(t,q)]-p['upre'][(c,q)]
                assert xsend[u] is None
                if ce: assert D[c]+q*Sd[c]<=u<D[c]+q*Sd[c]+p['usend'][c][q]<=D[c]+(q+1)*Sd[c]
                xsend[u]=(me,t)
                for k in range(K):
                    s=t*K+k; e=idx[s]; v=-1
                    if owner(E,W,e)==q:
                        j=sendpos[s]-p['ctab'][(c,e)]
                        assert 0<=e-first(E,W,q)<128 and 0<=j<(1<<24)
                        v=((e-first(E,W,q))<<24)|j
                        assert v>=0 and v>>24==e-first(E,W,q) and v&0xffffff==j
                    msend[u*K+k]=v
        if ce:
            assert sum(x is not None for x in xsend)==p['usbase'][C]
            # sendpos: owner o's rows of chunk c in o's return slot of yrecv
            for s_ in range(S):
                c=part(s_//K,T,C); o=owner(E,W,idx[s_])
                assert B[c]+o*Rs[c]<=sendpos[s_]<B[c]+o*Rs[c]+p['send_rows'][c][o]
        else:
            assert all(x is not None for x in xsend)
        R['sendpos']=sendpos; R['xsend']=xsend; R['msend']=msend
    # dispatch: owner me receives from q chunk c
    for me in range(W):
        p=plans[me]; nur=D[C] if ce else p['urbase'][C]
        xrecv=[None]*nur; mrecv=[None]*(nur*K)
        for c in range(C) if ce else ():  # ncclAlltoAll of Sd[c] rows (and Sd[c] K int32) a peer
            for q in range(W):
                for u in range(Sd[c]):
                    xrecv[D[c]+q*Sd[c]+u]=ranks[q]['xsend'][D[c]+me*Sd[c]+u]
                    for k in range(K): mrecv[(D[c]+q*Sd[c]+u)*K+k]=ranks[q]['msend'][(D[c]+me*Sd[c]+u)*K+k]
        for c in range(C) if not ce else ():
            ro=p['urbase'][c]
            for q in range(W):
                pq=plans[q]; nr=p['urecv'][c][q]
                so=pq['usbase'][c]+sum(pq['usend'][c][:me])
                assert pq['usend'][c][me]==nr
                for u in range(nr):
                    xrecv[ro+u]=ranks[q]['xsend'][so+u]
                    for k in range(K): mrecv[(ro+u)*K+k]=ranks[q]['msend'][(so+u)*K+k]
                ro+=nr
        # index + gemm
        N=p['rbase'][C]
        gidx=[None]*N; sidx=[None]*N
        for c in range(C):
            rb=p['rbase'][c]
            for q in range(W):
                for kk in range(p['urn'][(c,q)]*K):
                    v=mrecv[p['ur0'][(c,q)]*K+kk]
                    if v<0: continue
                    i=v>>24; j=v&0xffffff
                    g=p['goff'][(c,q,i)]+j
                    assert gidx[rb+g] is None
                    gidx[rb+g]=p['ur0'][(c,q)]+kk//K; sidx[rb+g]=rb+p['roff'][(c,q,i)]+j
        assert all(x is not None for x in gidx)
        if ce:  # each GEMM row returns into its source's slot of its chunk, once
            assert len(set(sidx))==N
            for c in range(C):
                rb=p['rbase'][c]
                # the sorted-mode scratch [B[c], B[c] + rows) stays in the chunk's region
                assert p['rbase'][c+1]-rb<=W*Rs[c]
                for g in range(p['rbase'][c+1]-rb):
                    src=xrecv[gidx[rb+g]][0]  # the row came from rank src's slot
                    assert D[c]+src*Sd[c]<=gidx[rb+g]<D[c]+src*Sd[c]+p['urecv'][c][src]
                    assert B[c]+src*Rs[c]<=sidx[rb+g]<B[c]+src*Rs[c]+p['recv_rows'][c][src]
        else:
            assert sorted(sidx)==list(range(N))
        if ce:  # inference only: no weight-gradient indices
            ysend=[None]*B[C]
            for c in range(C):
                rb=p['rbase'][c]; offs=p['offsc'][c]
                for i in range(p['ne']):
                    for g in range(offs[i],offs[i+1]):
                        ysend[sidx[rb+g]]=(p['fst']+i,xrecv[gidx[rb+g]])
            ranks[me].update(gidx=gidx,sidx=sidx,xrecv=xrecv,ysend=ysend)
            continue
        # global expert-major rows (wbase as epd_plan)
        ne=p['ne']; goffs=[0]*(ne+1)
        for i in range(ne):
            goffs[i+1]=goffs[i]+sum(p['offsc'][c][i+1]-p['offsc'][c][i] for c in range(C))
        wbase={}
        for i in range(ne):
            g0=goffs[i]
            for c in range(C):
                offs=p['offsc'][c]
                for q in range(W): wbase[(c,q,i)]=g0+p['goff'][(c,q,i)]-offs[i]
                g0+=offs[i+1]-offs[i]
        wgh=[None]*N; wgx=[None]*N; wgy=[None]*N
        for c in range(C):  # k_epd_index's grid (ceil(max_urn*K/NT), W) covers every entry
            mx=max([p['urn'][(c,q)] for q in range(W)]+[0])
            assert ((mx*K+NT-1)//NT)*NT>=mx*K
        for c in range(C):
            rb=p['rbase'][c]; offs=p['offsc'][c]
            for q in range(W):
                for kk in range(p['urn'][(c,q)]*K):
                    v=mrecv[p['ur0'][(c,q)]*K+kk]
                    if v<0: continue
                    i=v>>24; j=v&0xffffff
                    G=wbase[(c,q,i)]+j; g=p['goff'][(c,q,i)]+j
                    assert goffs[i]<=G<goffs[i+1] and wgh[G] is None
                    wgh[G]=rb+g; wgx[G]=p['ur0'][(c,q)]+kk//K; wgy[G]=rb+p['roff'][(c,q,i)]+j
                    assert wgx[G]==gidx[rb+g] and wgy[G]==sidx[rb+g]
                    assert p['rbase'][c]<=wgy[G]<p['rbase'][c+1]
                    assert offs[i]<=g<offs[i+1]
        assert sorted(wgh)==list(range(N)) and sorted(wgy)==list(range(N))
        assert all(x is not None for x in wgx)
        ranks[me].update(gidx=gidx,sidx=sidx,wgx=wgx,wgh=wgh,wgy=wgy,xrecv=xrecv,goffs=goffs)
        if C==1: assert wgh==list(range(N))
        ysend=[None]*N
        for c in range(C):
            rb=p['rbase'][c]; offs=p['offsc'][c]
            for i in range(p['ne']):
                for g in range(offs[i],offs[i+1]):
                    tok=xrecv[gidx[rb+g]]
                    ysend[sidx[rb+g]]=(p['fst']+i,tok)
        ranks[me]['ysend']=ysend
    # return + combine check
    for me in range(W):
        p=plans[me]; R=ranks[me]
        yrecv=[None]*(B[C] if ce else p['sbase'][C])
        for c in range(C) if ce else ():  # ncclAlltoAll of R[c] rows a peer
            for o in range(W):
                for u in range(Rs[c]):
                    yrecv[B[c]+o*Rs[c]+u]=ranks[o]['ysend'][B[c]+me*Rs[c]+u]
        for c in range(C) if not ce else ():
            so=p['sbase'][c]
            for q in range(W):
                pq=plans[q]; ns=p['send_rows'][c][q]
                ro=pq['rbase'][c]+sum(pq['recv_rows'][c][:me])
                assert pq['recv_rows'][c][me]==ns
                for u in range(ns): yrecv[so+u]=ranks[q]['ysend'][ro+u]
                so+=ns
        for s in range(R['T']*K):
            assert yrecv[R['sendpos'][s]]==(R['idx'][s],(me,s//K)), (me,s)
    if ce:  # every pair's rows fit its slot (the all-to-all pairs itself)
        for c in range(C):
            for me in range(W):
                assert max(plans[me]['usend'][c])<=Sd[c] and max(plans[me]['recv_rows'][c])<=Rs[c]
        return padded,real
    # backward (ep_pipeline bwd after a dedup forward): k_ep_dy writes the
    # w dy row of slot s at xsend[sendpos[s]]; ep_exchange sends it along the
    # return layout (send_rows / recv_rows) into ysend; the owner reads GEMM
    # row g's dy through sidx (dh), scatters dx through sidx (dxsend), and
    # the dx rows come back into yrecv[sendpos[s]]
    def exchange(src,dst_of,fwd):
        for me in range(W):
            p=plans[me]
            for c in range(C):
                so=p['sbase'][c]
                for q in range(W):
                    pq=plans[q]; ns=p['send_rows'][c][q]
                    ro=pq['rbase'][c]+sum(pq['recv_rows'][c][:me])
                    for u in range(ns):
                        if fwd: dst_of[q][ro+u]=src[me][so+u]
                        else: dst_of[me][so+u]=src[q][ro+u]
                    so+=ns
    xsb=[[None]*plans[me]['sbase'][C] for me in range(W)]
    for me in range(W):
        R=ranks[me]
        for s in range(R['T']*K): xsb[me][R['sendpos'][s]]=('wdy',me,s)
    ysb=[[None]*plans[me]['rbase'][C] for me in range(W)]
    exchange(xsb,ysb,1)
    dxs=[[None]*plans[me]['rbase'][C] for me in range(W)]
    for me in range(W):
        p=plans[me]; R=ranks[me]
        for c in range(C):
            rb=p['rbase'][c]
            for g in range(p['offsc'][c][p['ne']]):
                i=next(i for i in range(p['ne']) if p['offsc'][c][i]<=g<p['offsc'][c][i+1])
                _,src,s=ysb[me][R['sidx'][rb+g]]
                # the dy row is that of the forward row's (token, expert)
                assert R['xrecv'][R['gidx'][rb+g]]==(src,s//K) and ranks[src]['idx'][s]==p['fst']+i
                dxs[me][R['sidx'][rb+g]]=('dx',p['fst']+i,src,s//K)
        # dW2: the dy rows through wgy are the activation rows' (wgh) slots
        for G in range(p['rbase'][C]):
            assert ysb[me][R['wgy'][G]][1:]==ysb[me][R['sidx'][R['wgh'][G]]][1:]
            i=next(i for i in range(p['ne']) if R['goffs'][i]<=G<R['goffs'][i+1])
            _,src,s=ysb[me][R['wgy'][G]]
            assert ranks[src]['idx'][s]==p['fst']+i and R['xrecv'][R['wgx'][G]]==(src,s//K)
    yb=[[None]*plans[me]['sbase'][C] for me in range(W)]
    exchange(dxs,yb,0)
    for me in range(W):
        R=ranks[me]
        for s in range(R['T']*K):
            assert yb[me][R['sendpos'][s]]==('dx',R['idx'][s],me,s//K)
    # NCCL pairing in each chunk's group: rank a's sends to b, in order, are
    # b's receives from a (count, type), for epd_dispatch and ep_exchange
    def ops(me,c,kind):
        p=plans[me]; o=[]
        for q in range(W):
            if kind=='disp':
                ns,nr=p['usend'][c][q],p['urecv'][c][q]
                if ns: o+=[('send',q,ns*1024,'bf16'),('send',q,ns*K,'i32')]
                if nr: o+=[('recv',q,nr*1024,'bf16'),('recv',q,nr*K,'i32')]
            else:  # ep_exchange: fwd (bwd dispatch) or back (returns)
                ns,nr=p['send_rows'][c][q],p['recv_rows'][c][q]
                a,b=(ns,nr) if kind=='fwd' else (nr,ns)
                if a: o.append(('send',q,a*1024,'bf16'))
                if b: o.append(('recv',q,b*1024,'bf16'))
        return o
    for c in range(C):
        for kind in ('disp','fwd','back'):
            o=[ops(me,c,kind) for me in range(W)]
            for a in range(W):
                for b in range(W):
                    snd=[x[2:] for x in o[a] if x[0]=='send' and x[1]==b]
                    rcv=[x[2:] for x in o[b] if x[0]=='recv' and x[1]==a]
                    assert snd==rcv,(c,kind,a,b)
    return sum(p['usbase'][C] for p in plans), sum(len(r['idx']) for r in ranks)

def main():
    for seed in range(40):
        rnd=random.Random(1000+seed)
        W=rnd.choice([2,3,4,5,8]); E=rnd.choice([W*2,16,24,64]); E=max(E,W); K=rnd.randint(1,min(8,E))
        Ts=[rnd.choice([0,1,3,7,50,130]) for _ in range(W)]
        C=rnd.choice([1,2,3,4]); P=8 if C in (1,2,4) and rnd.random()<0.3 else C*rnd.choice([1,2])
        run(W,E,K,Ts,C,P,seed)
    named=[(2,4,2,[0,5],1,1),(3,6,2,[0,0,0],2,2),(4,10,3,[3,0,1,2],4,8),(4,10,3,[3,0,1,2],1,8),
           (5,24,4,[7,1,0,300,2],4,8),(5,24,4,[7,1,0,300,2],1,8),(7,7,3,[2,9,0,1,4,3,8],3,3),
           (3,9,1,[600,0,257],4,8),(2,16,8,[513,40],8,8),(4,129,8,[700,3,0,1],4,8),
           (64,64,8,[3]*64,2,8),(6,13,5,[1,2,3,4,5,6],5,5)]
    for n,(W,E,K,Ts,C,P) in enumerate(named):
        run(W,E,K,Ts,C,P,500+n)
    # the copy-engine exchange's padded layout: random cases, T=0 on some
    # ranks, W=2..8, uneven experts per rank (E not a multiple of W)
    for seed in range(40):
        rnd=random.Random(3000+seed)
        W=rnd.randint(2,8); E=rnd.choice([W,W+1,2*W+3,16,24,64,129]); E=max(E,W)
        K=rnd.randint(1,min(8,E))
        Ts=[rnd.choice([0,0,1,3,7,50,130,300]) for _ in range(W)]
        C=rnd.choice([1,2,3,4]); P=8 if C in (1,2,4) and rnd.random()<0.3 else C*rnd.choice([1,2])
        run(W,E,K,Ts,C,P,seed,ce=True)
    for n,(W,E,K,Ts,C,P) in enumerate(named):
        run(W,E,K,Ts,C,P,700+n,ce=True)
    pd,rl=run(4,128,8,[2000]*4,4,8,1,ce=True)
    print("ep_dedup_layout: copy-engine padded layout: 40 random and %d named cases pass; "
          "Qwen3-like 4 ranks x 2000 tokens, 4 chunks: padded / real rows %.3f"
          % (len(named),pd/rl))
    u,s=run(4,128,8,[2000]*4,4,8,1)
    print("ep_dedup_layout: 40 random and %d named cases pass; Qwen3-like 4 ranks x 2000 "
          "tokens: %d unique rows for %d slots" % (len(named),u,s))

if __name__ == "__main__":
    main()
